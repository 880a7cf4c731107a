"""Lock-step plans with parameters sharded through the step (docs/design/lockstep.md; trainer.lockstep, trainer.parallelize).

A windowed plan with recomputation on 2 and 4 ranks (the plan builder with a random partition,
some window parents recomputed) is aligned into lock-step phases by the test helper
(`tests.executor_helpers.lockstep_plan`, stand-ins included). Each rank builds only its FSDP2
shards on the meta device, gathers a unit for every forward and backward and reduce-scatters
after every backward; the full gradients must equal the one-process step over the whole plan
(relative difference <= 1e-6), every rank must issue the same collectives in the same order,
and no forward may return a view. One-process checks: stand-ins and the exact-zero term that
makes a backward reach every unit change no bit; misaligned slices and free plans are refused.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from planner_service.planner import PlanConfig
from planner_service.planner.build import build_plan
from plan.validator import validate_plan
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import forest_from_trajectories, random_partition, random_trajectories
from tests.dist_helpers import assert_ranks_match, spawn_ranks
from tests.executor_helpers import lockstep_plan
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.objectives import ObjectiveConfig

C = 8
SEED = 11
UNITS = 5  # 4 decoder blocks + the root
OBJECTIVE = ObjectiveConfig(entropy_coef=0.01, aggregation="seq-mean-token-mean")
#: (world size, seed of the random windowed partition); checked below to have windows and recomputation
CASES = {2: 0, 4: 1}


def _free_plan(world: int) -> plan_pb2.Plan:
    """A windowed plan on `world` ranks, every rank with microbatches, half the window parents recomputed."""
    seed = CASES[world]
    rng = np.random.default_rng(1000 + seed)
    trajs, tree_of = random_trajectories(rng, n=6 * world, max_len=40, vocab=200, trees=2 * world, chunk=C)
    f = forest_from_trajectories(trajs, vocab_size=256, tree_of=tree_of, seed=seed)
    part = random_partition(f, rng, chunk=C, world_size=world, windows=True, cut_prob=0.4)
    parents = {s.parent for s in part.microbatches if s.shared}
    for i, s in enumerate(part.microbatches):
        s.recompute = s.recompute or (i in parents and i % 2 == 0)
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=4096, memory_tokens=1 << 20, world_size=world,
                                    all_positions=True), part)
    validate_plan(plan, f)
    return plan


def _executor(model, **kw) -> Executor:
    kw = {"aux_loss_coef": 0.01, **kw}
    return Executor(model, ExecutorConfig(chunk_size=C, objective=OBJECTIVE, check_recompute=True, **kw))


def _worker(rank: int, world: int, port: int, plan_bytes: bytes, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainer.config import ParallelismSection
    from trainer.distributed import DistContext
    from trainer.param_memory import ParamGradGauge
    from trainer.parallelize import GradSync, make_mesh, parallelize, run_slice

    log: list[tuple[str, int]] = []
    real = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def logging_(name):
        def call(output, input, *a, **kw):
            log.append((name, int(input.numel())))
            return real[name](output, input, *a, **kw)
        return call

    for name in real:
        setattr(dist, name, logging_(name))
    try:
        ctx = DistContext(rank=rank, world_size=world, initialized=True)
        cfg = ParallelismSection(reshard_after_forward=True)
        mesh = make_mesh(cfg, ctx)
        model = build_model("tiny", seed=SEED, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
        local_elements = sum(p.to_local().numel() for p in model.parameters())
        plan, free = (plan_pb2.Plan.FromString(b) for b in plan_bytes)
        sync, gauge = GradSync(model, ctx, every_backward=True), ParamGradGauge(model)
        log.clear()
        gauge.begin_step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = run_slice(_executor(model, reach_all_units=True), plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[rank]),
                            sync)
        sync.finish_step(list(model.parameters()))
        gauge.sample()
        collectives = list(log)
        grads = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        # the same slice's free plan with every unit gathered for the step (reshard_after_forward=false)
        gathered = build_model("tiny", seed=SEED, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=False))
        sync, free_gauge = GradSync(gathered, ctx), ParamGradGauge(gathered)
        free_gauge.begin_step()
        run_slice(_executor(gathered, reach_all_units=True), plan_pb2.PlanSlice(header=free.header, rank=free.ranks[rank]), sync)
        sync.finish_step(list(gathered.parameters()))
        free_gauge.sample()
        units = {"root": _bytes(model, blocks=False), **{f"block {i}": _bytes(b) for i, b in enumerate(model.model.layers)}}
        queue.put((rank, {"grads": grads, "collectives": collectives, "loss": res.loss, "standins": res.standins,
                          "warnings": [str(w.message) for w in caught], "local_elements": local_elements,
                          "peak": gauge.peak, "peak_gathered": free_gauge.peak, "unit_bytes": units}))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()


def _bytes(module: torch.nn.Module, *, blocks: bool = True) -> int:
    """Full parameter bytes of a unit (the root: what no decoder block holds)."""
    skip = set() if blocks else {id(p) for b in module.model.layers for p in b.parameters()}
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in skip)


def _spawn(world: int, plan: plan_pb2.Plan, free: plan_pb2.Plan) -> dict:
    return spawn_ranks(_worker, world, ((plan.SerializeToString(), free.SerializeToString()),))


def _one_process(plan: plan_pb2.Plan, **kw) -> tuple[dict[str, np.ndarray], float]:
    torch.set_num_threads(1)
    model = build_model("tiny", seed=SEED)
    res = _executor(model, **kw).run_step(plan)
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}, res.loss


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def run(request):
    world = request.param
    free = _free_plan(world)
    plan = lockstep_plan(free)
    assert all(len(r.microbatches) for r in plan.ranks)
    assert sum(1 for r in plan.ranks for mb in r.microbatches if mb.recompute) >= 1
    assert sum(1 for r in plan.ranks for mb in r.microbatches if len(mb.import_row) or len(mb.state_imports)) >= world
    return world, free, plan, _spawn(world, plan, free)


@pytest.mark.integration
@pytest.mark.slow
def test_sharded_lockstep_step_equals_the_one_process_step(run):
    world, free, plan, out = run
    assert_ranks_match(out, *_one_process(free), f"{world} ranks")
    assert sum(out[r]["standins"] for r in range(world)) > 0


@pytest.mark.integration
@pytest.mark.slow
def test_every_rank_issues_the_same_collectives_and_reduces_after_every_backward(run):
    world, _, plan, out = run
    seqs = [out[r]["collectives"] for r in range(world)]
    assert all(s == seqs[0] for s in seqs), "ranks issued different collective sequences"
    backwards = sum(1 for s in plan.ranks[0].steps if s.kind == plan_pb2.ExecStep.BACKWARD)
    assert sum(1 for op, _ in seqs[0] if op == "reduce_scatter_single") == UNITS * backwards
    # gathered per forward and per backward (recomputed forwards included), not once per step
    assert sum(1 for op, _ in seqs[0] if op == "all_gather_single") > 2 * UNITS
    full = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    assert max(out[r]["local_elements"] for r in range(world)) <= 1.1 * full / world  # a shard, not the model


@pytest.mark.integration
@pytest.mark.slow
def test_no_forward_returns_a_view(run):
    world, _, _, out = run
    for rank in range(world):
        assert not [w for w in out[rank]["warnings"] if "view tensor" in w], out[rank]["warnings"]


@pytest.mark.integration
@pytest.mark.slow
def test_peak_parameter_and_gradient_bytes_are_a_shard_plus_a_few_units(run):
    """Measured peak_param_grad_bytes: sharded through the step, a rank holds its shards plus at most
    three gathered units with their gradients; with units gathered for the step, the full
    parameters plus full gradients."""
    world, _, _, out = run
    model = build_model("tiny", seed=0)
    full = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in range(world):
        o = out[rank]
        unit = 2 * max(o["unit_bytes"].values())
        print(f"{world} ranks, rank {rank}: peak_param_grad_bytes {o['peak']} sharded, {o['peak_gathered']} gathered, "
              f"full {full}, bound {full // world + 3 * unit}")
        assert full / world < o["peak"] <= full / world + 3 * unit
        assert o["peak_gathered"] > full / 2 + full / world  # all parameters gathered, plus shards and gradients
        assert o["peak"] < o["peak_gathered"]


def test_param_grad_gauge_of_a_plain_module_counts_every_parameter_and_gradient_once():
    from trainer.param_memory import ParamGradGauge

    cfg = build_model("tiny", seed=0).config
    cfg.tie_word_embeddings = True
    from trainer.models import Qwen3NextForRL

    model = Qwen3NextForRL(cfg)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied matrix once
    gauge = ParamGradGauge(model)
    gauge.begin_step()
    assert gauge.peak == params
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert gauge.sample() == 2 * params == gauge.peak


def test_lockstep_plan_and_the_zero_term_change_no_bit_in_one_process():
    free = _free_plan(2)
    plan = lockstep_plan(free)
    ref, loss = _one_process(free)
    for kw in ({}, {"reach_all_units": True}, {"validate": "full"}):  # the oracle checks stand-ins too
        got, got_loss = _one_process(plan, **kw)
        assert got_loss == loss and got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref), kw


def test_standin_backward_reaches_every_unit_with_exact_zeros(monkeypatch):
    """A rank with stand-ins only (all four kinds): exact-zero gradients, and every decoder block and
    the final norm reached. The exact-zero term guarantees the reach: with a loss that does not
    depend on the model (as an objective may return for a microbatch without log-prob entries)
    only the term makes the backward touch the units."""
    from trainer import executor as executor_mod
    from trainer.loss import microbatch_loss

    free = _free_plan(2)
    idle = min((0, 1), key=lambda r: sum(mb.recompute for mb in free.ranks[r].microbatches))
    del free.ranks[idle].microbatches[:]
    del free.ranks[idle].steps[:]
    plan = lockstep_plan(free)
    sl = plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[idle])
    kinds = {(s.kind, bool(s.standin)) for s in sl.rank.steps}
    assert kinds == {(plan_pb2.ExecStep.FORWARD, False), (plan_pb2.ExecStep.FORWARD, True),
                     (plan_pb2.ExecStep.BACKWARD, False), (plan_pb2.ExecStep.BACKWARD, True)}, kinds

    def constant_loss(*a, **kw):
        out = microbatch_loss(*a, **kw)
        out.loss = out.loss.detach()
        return out

    for detached in (False, True):
        if detached:
            monkeypatch.setattr(executor_mod, "microbatch_loss", constant_loss)
        for reach in (False, True):
            model = build_model("tiny", seed=SEED)
            res = _executor(model, reach_all_units=reach, validate="none", aux_loss_coef=0.0).run_step(sl)
            assert res.loss == 0.0 and res.microbatches == 0 and res.standins == len(sl.rank.steps)
            assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)
            touched = {n for n, p in model.named_parameters() if p.grad is not None}
            units = {f"model.layers.{i}.input_layernorm.weight" for i in range(len(model.model.layers))}
            units.add("model.norm.weight")
            assert (units <= touched) is (reach or not detached), (detached, reach, sorted(units - touched))


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.steps.pop(), r"rank \d\.steps: expected 16 steps, one per phase of header.lockstep_phases, got 15"),
    (lambda r: setattr(r.steps[0], "kind", plan_pb2.ExecStep.BACKWARD),
     r"rank \d\.steps\[0\]: expected a PHASE_FORWARD step \(FORWARD\), got BACKWARD"),
    (lambda r: [setattr(s, "standin", 0) for s in r.steps if s.microbatch < 0 and s.standin],
     r"expected a BACKWARD stand-in paired with an earlier FORWARD stand-in"),
], ids=["count", "kind", "pair"])
def test_misaligned_slices_are_refused_before_anything_runs(edit, message):
    """The executor refuses them through the slice check (plan.phases' rules), naming the step."""
    plan = lockstep_plan(_free_plan(2))
    assert len(plan.header.lockstep_phases) == 16
    rank = next(r for r in plan.ranks if any(s.microbatch < 0 and s.standin for s in r.steps))
    edit(rank)
    model = build_model("tiny", seed=SEED)
    with pytest.raises(ValueError, match=message):
        _executor(model).run_step(plan_pb2.PlanSlice(header=plan.header, rank=rank))
    assert all(p.grad is None for p in model.parameters())


def test_a_free_plan_is_refused_when_parameters_are_sharded_through_the_step():
    from trainer.loop import TrainError, _Run, _train_step

    plan = _free_plan(2)
    sl = plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[0])
    from trainer.config import TrainerConfig

    run = _Run(cfg=TrainerConfig(), ctx=None, stop=None, model=None, params=[], opt=None, executor=None,
               stand_in=None, sync=None, reshard=True, start=0)
    with pytest.raises(TrainError, match=r"parallelism.reshard_after_forward is true, which needs a lock-step plan.*"
                                         r"topology.lockstep=true"):
        _train_step(sl, 0, run)
