"""Windows across ranks (docs/design/cross-rank.md; plan.cross_edges, trainer.cross_rank, trainer.executor).

Plans: the planner's lock-step plans of small synthetic batches with a small memory budget
(windows nested, exporters recomputed), in which `tests.executor_helpers.cross_rank_plan` moves
window importers (with the steps between their FORWARD and BACKWARD) to other ranks and emits the
cross edges. The step is the same, so its gradients must equal those of the plan without crossing
windows: in one process (every rank here, `LocalTransport`) and on 2 and 4 gloo ranks with FSDP2
parameters sharded through the step (`P2PTransport`), relative difference <= 1e-6. The slice check
refuses broken edges naming them; a rank whose peer dies or hangs mid-exchange fails with an
error naming the phase, the edge and the peer instead of waiting forever. End to end, the
planner's own crossing plan (a tree split over 2 ranks, its prefix computed once) passes the
validator and runs on 2 gloo ranks with the gradients of the one-process step.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harts_client.synthetic import generate
from plan.microbatch import PlanValidationError
from plan.slice_check import check_rank
from plan.validator import validate_plan
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from proto.arrays import pack, unpack
from proto.harts.v1 import plan_pb2
from tests.dist_helpers import assert_ranks_match, rel_grad_diff, spawn_ranks
from tests.executor_helpers import cross_rank_plan
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.objectives import ObjectiveConfig

C = 16
SEED = 5
OBJECTIVE = ObjectiveConfig(entropy_coef=0.01, aggregation="seq-mean-token-mean")
#: world size -> (scheme, tasks, seed, memory_tokens): batches whose lock-step plans nest windows and recompute
BATCHES = {2: ("percall", 2, 1, 96), 4: ("tree", 3, 2, 64)}


def _lockstep(world: int, memory_tokens: int | None = None, *, lockstep: bool = True) -> plan_pb2.Plan:
    scheme, tasks, seed, memory = BATCHES[world]
    doc = generate(scheme=scheme, tasks=tasks, seed=seed, scale=0.01, turns=(2, 3), old_logprobs=True)
    return plan_step(forest_from_json(doc), PlanConfig(
        chunk_size=C, microbatch_tokens=64, world_size=world, memory_tokens=memory_tokens or memory, lockstep=lockstep,
        model_config=build_model("tiny", seed=0).config.to_hf_dict(), model_name="tiny", cross_rank_windows=False))


def _crossing(plan: plan_pb2.Plan, edges: int, seed: int = 0) -> plan_pb2.Plan:
    """`plan` with window importers moved to other ranks until it has `edges` cross edges."""
    rng = np.random.default_rng(seed)
    W = len(plan.ranks)
    importers = [mb.id for r in plan.ranks for mb in r.microbatches if len(mb.import_row) or len(mb.state_imports)]
    rng.shuffle(importers)
    for m in importers:
        here = next(r.rank for r in plan.ranks if any(mb.id == m for mb in r.microbatches))
        try:
            plan = cross_rank_plan(plan, m, int((here + 1 + rng.integers(W - 1)) % W), rng)
        except AssertionError:  # its block holds an edge's microbatch already, or it imports from inside it
            continue
        if _edges(plan) >= edges:
            return plan
    raise AssertionError(f"only {_edges(plan)} cross edges")


def _edges(plan: plan_pb2.Plan) -> int:
    return sum(len(r.cross_edges) for r in plan.ranks) // 2


def _shape(plan: plan_pb2.Plan) -> dict:
    """What the crossing windows of a plan exercise."""
    mbs = {mb.id: mb for r in plan.ranks for mb in r.microbatches}
    edges = {e.id: e for r in plan.ranks for e in r.cross_edges}.values()
    return {"edges": len(edges), "recomputed exporters": sum(mbs[e.exporter].recompute for e in edges),
            "kept exporters": sum(not mbs[e.exporter].recompute for e in edges),
            "importers that export": sum(len(mbs[e.importer].export_rows) > 0 for e in edges),
            "exporters that import": sum(len(mbs[e.exporter].import_row) > 0 for e in edges),
            "edges with states": sum(len(e.states) > 0 for e in edges)}


def _executor(model, **kw) -> Executor:
    transport = kw.pop("transport", None)
    cfg = {"chunk_size": C, "objective": OBJECTIVE, "aux_loss_coef": 0.01, "check_recompute": True} | kw
    return Executor(model, ExecutorConfig(**cfg), transport=transport)


def _one_process(plan, **kw) -> tuple[dict[str, np.ndarray], float]:
    torch.set_num_threads(1)
    model = build_model("tiny", seed=SEED)
    res = _executor(model, **kw).run_step(plan)
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}, res.loss


@pytest.mark.parametrize("world,memory", [(2, None), (2, 256), (4, None)], ids=["2-ranks-recompute", "2-ranks-kept", "4-ranks"])
def test_crossing_windows_in_one_process_equal_the_plan_without_them(world, memory):
    plan = _lockstep(world, memory)
    crossing = _crossing(plan, 3)
    shape = _shape(crossing)
    print(world, memory, shape)
    if memory is None:
        assert shape["recomputed exporters"] and shape["edges with states"]
        assert shape["importers that export"] or shape["exporters that import"]  # nested windows cross too
    else:
        assert shape["kept exporters"]
    for r in crossing.ranks:
        check_rank(crossing.header, r)
    validate_plan(crossing)
    want, loss = _one_process(plan)
    got, got_loss = _one_process(crossing, reach_all_units=True)
    rel = rel_grad_diff(got, want)
    print(f"{world} ranks, {shape['edges']} cross edges: relative gradient difference {rel:.3g}")
    assert rel <= 1e-6 and abs(got_loss - loss) <= 1e-6 * max(1.0, abs(loss))


def test_dropping_the_returned_gradients_breaks_exactness(monkeypatch):
    """The equality above needs the gradients that come back over the edges."""
    from trainer.cross_rank import RankEdges

    plan = _lockstep(2)
    crossing = _crossing(plan, 3)
    complete = RankEdges.complete
    monkeypatch.setattr(RankEdges, "complete", lambda self, ts, open_: complete(self, [t for t in ts if not t.grad], open_))
    got, _ = _one_process(crossing)
    want, _ = _one_process(plan)
    assert rel_grad_diff(got, want) > 1e-3


def test_edge_wire_matches_the_memory_model_and_round_trips_mixed_dtypes():
    from plan.cross_edges import decode_edges
    from trainer.boundary import export_layout
    from trainer.cross_rank import EdgeWire

    crossing = _crossing(_lockstep(2), 3)
    model = build_model("tiny", seed=SEED)
    layout = export_layout(model.config, torch.float32)
    for r in crossing.ranks:
        for e in decode_edges(r):  # fp32: every tensor is 4 bytes an element, as the memory model counts
            assert EdgeWire.of(e, layout).nbytes == e.bytes > 0
    from plan.cross_edges import CrossEdgeArrays

    rows = {"attn": np.arange(3), "conv": np.arange(1), "kernel": np.arange(3)}
    e = CrossEdgeArrays(id=0, exporter=0, exporter_rank=0, importer=1, importer_rank=1, rows=rows, states=np.arange(1),
                        send_phase=0, grad_phase=1, bytes=0)
    wire = EdgeWire.of(e, export_layout(model.config, torch.bfloat16))  # bf16 rows, fp32 g and states: odd offsets
    assert [name for name, *_ in wire.entries][:8] == ["0.conv", "0.q", "0.k", "0.v", "0.g", "0.beta", "0.state", "1.conv"]
    assert [name for name, *_ in wire.entries][-2:] == ["3.attn_k", "3.attn_v"]
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn((n, *shape), generator=g).to(dtype) for name, n, shape, dtype in wire.entries}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16, torch.float32}
    back = wire.unpack(wire.pack(tensors, torch.device("cpu")))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def _edge_of(plan, side: str):
    """(rank plan of the exporter's or importer's side, its first edge)."""
    e = next(e for r in plan.ranks for e in r.cross_edges)
    rank = plan.ranks[e.exporter_rank if side == "exporter" else e.importer_rank]
    return rank, next(x for x in rank.cross_edges if x.id == e.id)


def _phase(rank, mb_id, kind):
    idx = [mb.id for mb in rank.microbatches].index(mb_id)
    return next(p for p, s in enumerate(rank.steps) if s.microbatch == idx and s.kind == kind)


F_, B_ = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD


@pytest.mark.parametrize("side,edit,message", [
    ("importer", lambda r, e: setattr(e, "send_phase", _phase(r, e.importer, F_)), r"send_phase: expected < \d+ \(the importer's FORWARD phase\)"),
    ("exporter", lambda r, e: setattr(e, "send_phase", _phase(r, e.exporter, F_) - 1), r"send_phase: expected >= \d+ \(the exporter's FORWARD phase\)"),
    ("importer", lambda r, e: setattr(e, "grad_phase", _phase(r, e.importer, B_) - 1), r"grad_phase: expected >= \d+ \(the importer's BACKWARD phase\)"),
    ("exporter", lambda r, e: setattr(e, "grad_phase", _phase(r, e.exporter, B_)), r"grad_phase: expected < \d+ \(the exporter's BACKWARD phase\)"),
    ("exporter", lambda r, e: setattr(e, "attn_rows", pack([*unpack(e.attn_rows, "int32"), 10**6], "int32")),
     r"attn_rows: expected rows of microbatch \d+'s export_rows, got 1000000"),
    ("importer", lambda r, e: setattr(e, "kernel_rows", pack([10**6], "int32")),
     r"kernel_rows: expected rows microbatch \d+ imports from microbatch \d+, got 1000000"),
    ("importer", lambda r, e: setattr(e, "states", b""), r"states: expected every state microbatch \d+ imports from microbatch \d+"),
    ("importer", lambda r, e: setattr(e, "exporter_rank", e.importer_rank), r"expected two different ranks"),
    ("importer", lambda r, e: setattr(e, "bytes", e.bytes + 1), r"bytes: expected \d+ \(the memory model of its rows and states\)"),
    ("importer", lambda r, e: r.cross_edges.pop(), r"imports from microbatch \d+, which is not an open window on this rank"),
], ids=["send-early", "send-before-export", "grad-early", "grad-late", "rows-exporter", "rows-importer", "states",
        "ranks", "bytes", "missing"])
def test_broken_cross_edges_are_refused_by_the_slice_check(side, edit, message):
    crossing = _crossing(_lockstep(2), 1)
    rank, e = _edge_of(crossing, side)
    edit(rank, e)
    with pytest.raises(PlanValidationError, match=message):
        check_rank(crossing.header, rank)


def test_cross_edges_in_a_free_plan_and_unpaired_edges_are_refused():
    from plan.cross_edges import check_plan_edges

    crossing = _crossing(_lockstep(2), 1)
    free = _lockstep(2, lockstep=False)
    rank, e = _edge_of(crossing, "exporter")
    free.ranks[rank.rank].cross_edges.add().CopyFrom(e)
    with pytest.raises(PlanValidationError, match=r"cross_edges: expected none in a free plan"):
        check_rank(free.header, free.ranks[rank.rank])
    check_plan_edges(list(crossing.ranks))
    importer, e2 = _edge_of(crossing, "importer")
    e2.grad_phase += 1
    with pytest.raises(PlanValidationError, match=r"cross edge \d+: ranks \d and \d list it differently"):
        check_plan_edges(list(crossing.ranks))
    e2.grad_phase -= 1
    check_plan_edges(list(crossing.ranks))
    del importer.cross_edges[[x.id for x in importer.cross_edges].index(e2.id)]
    with pytest.raises(PlanValidationError, match=r"cross edge \d+: expected it on its exporter's and its importer's rank"):
        check_plan_edges(list(crossing.ranks))


def test_a_slice_with_cross_edges_needs_a_transport():
    crossing = _crossing(_lockstep(2), 1)
    rank, _ = _edge_of(crossing, "importer")
    model = build_model("tiny", seed=SEED)
    with pytest.raises(ValueError, match=r"cross edges \(windows across ranks\) but the executor has no transport"):
        _executor(model).run_step(plan_pb2.PlanSlice(header=crossing.header, rank=rank))
    assert all(p.grad is None for p in model.parameters())


# ---- several processes (gloo)


def _worker(rank: int, world: int, port: int, plan_bytes: bytes, mode: str, queue) -> None:
    """One rank: "fsdp" runs its slice with FSDP2 sharded through the step and reports the full
    gradients; "die" / "stall": rank 1 dies / hangs at its first exchange, rank 0 reports its error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainer.cross_rank import CrossRankError, P2PTransport
    from trainer.distributed import DistContext
    from trainer.parallelize import GradSync, make_mesh, parallelize, run_slice

    plan = plan_pb2.Plan.FromString(plan_bytes)
    sl = plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[rank])
    try:
        if mode == "fsdp":
            from trainer.config import ParallelismSection

            ctx = DistContext(rank=rank, world_size=world, initialized=True)
            cfg = ParallelismSection(reshard_after_forward=True)
            mesh = make_mesh(cfg, ctx)
            model = build_model("tiny", seed=SEED, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
            log: list[str] = []
            real = dist.batch_isend_irecv
            dist.batch_isend_irecv = lambda ops: (log.append(len(ops)), real(ops))[1]
            sync = GradSync(model, ctx, every_backward=True)
            res = run_slice(_executor(model, reach_all_units=True, transport=P2PTransport(60.0)), sl, sync)
            sync.finish_step(list(model.parameters()))
            grads = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
            queue.put((rank, {"grads": grads, "loss": res.loss, "batches": log}))
            return
        model = build_model("tiny", seed=SEED)  # a full replica: the exchange alone is under test
        transport = P2PTransport(2.0 if mode == "stall" else 60.0)
        if rank == 1:
            def fail(phase, transfers, kind=None):
                if transfers:
                    if mode == "die":
                        os._exit(3)
                    time.sleep(120)
                return P2PTransport.run(transport, phase, transfers, kind)
            transport.run = fail
        try:
            _executor(model, transport=transport).run_step(sl)
            queue.put((rank, "no error"))
        except CrossRankError as exc:
            queue.put((rank, str(exc)))
    finally:
        if mode == "fsdp":
            dist.destroy_process_group()


def _spawn(world: int, plan: plan_pb2.Plan, mode: str, want: int) -> dict:
    """Start `world` ranks; the results of the first `want` ranks that report (the rest killed
    in the failure modes)."""
    return spawn_ranks(_worker, world, (plan.SerializeToString(), mode), want=want if mode != "fsdp" else None,
                       kill=mode != "fsdp")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def fsdp_run(request):
    world = request.param
    plan = _lockstep(world)
    crossing = _crossing(plan, 3, seed=world)
    return world, plan, crossing, _spawn(world, crossing, "fsdp", world)


@pytest.mark.integration
@pytest.mark.slow
def test_crossing_windows_on_gloo_ranks_with_sharded_parameters_equal_the_one_process_step(fsdp_run):
    world, plan, crossing, out = fsdp_run
    assert_ranks_match(out, *_one_process(plan), f"{world} ranks ({_shape(crossing)})")
    # the ranks of each edge posted their operations: one batch per phase with transfers on that rank
    posted = {r: sum(out[r]["batches"]) for r in range(world)}
    edges = {e.id: e for r in crossing.ranks for e in r.cross_edges}.values()
    for r in range(world):
        assert posted[r] == 2 * sum(r in (e.exporter_rank, e.importer_rank) for e in edges), (r, posted)


@pytest.mark.integration
@pytest.mark.parametrize("mode,cause", [("die", r"failed after [\d.]+ s"), ("stall", r"not done after parallelism.p2p_timeout_s = 2 s")],
                         ids=["peer-dies", "peer-hangs"])
def test_a_peer_lost_mid_exchange_fails_the_rank_naming_phase_edge_and_peer(mode, cause):
    crossing = _crossing(_lockstep(2), 1)
    out = _spawn(2, crossing, mode, want=1)
    msg = out[0]
    assert isinstance(msg, str) and msg != "no error", msg
    e = next(e for e in crossing.ranks[0].cross_edges)
    # the exports' phase; a send into the dead peer's socket may still succeed, then the gradients' phase fails
    phases = rf"({e.send_phase}|{e.grad_phase})" if mode == "die" else str(e.send_phase)
    assert re.search(rf"phase {phases} \(PHASE_\w+\), cross edge {e.id} \(microbatch {e.exporter} -> {e.importer}\): "
                     rf"rank 0 (sending|receiving) (exports|gradients) (to|from) rank 1", msg), msg
    assert re.search(cause, msg) and "is rank 1 alive" in msg, msg


# ---- the planner's own windows across ranks, end to end


def _planner_crossing() -> tuple:
    """(forest, the planner's lock-step plan with windows across ranks, the same step planned
    without them) for 2 ranks: one percall tree (200 distinct tokens) split over both ranks, B =
    64 rows and a live budget of 96 row-equivalents, where `plan_step` prefers the crossing plan
    (the tree's prefix computed once, imported by the other rank)."""
    doc = generate(scheme="percall", tasks=1, seed=0, scale=0.01, turns=(2, 3), old_logprobs=True)
    forest = forest_from_json(doc)
    cfg = PlanConfig(chunk_size=C, microbatch_tokens=64, world_size=2, memory_tokens=96, lockstep=True,
                     model_config=build_model("tiny", seed=0).config.to_hf_dict(), model_name="tiny")
    return forest, plan_step(forest, cfg), plan_step(forest, dataclasses.replace(cfg, cross_rank_windows=False))


@pytest.mark.integration
@pytest.mark.slow
def test_the_planners_crossing_windows_on_two_gloo_ranks_equal_the_one_process_step():
    """Not hand-built: the planner chooses and writes the cross edges, the validator and the slice
    check accept them, and 2 gloo ranks with FSDP2 running them have the loss and gradients of the
    one-process step of the same plan. That step is the batch's: without the MoE load-balancing
    loss (a microbatch's own statistics, so it depends on the partition) it equals
    the one-process step of the batch planned without windows across ranks."""
    from plan.seal import slice_plan
    from plan.validator import validate_slice

    forest, crossing, base = _planner_crossing()
    st = crossing.header.stats
    assert crossing.header.params.cross_rank_windows and st.cross_edges >= 1 and _edges(crossing) == st.cross_edges
    assert st.duplicated_tokens < base.header.stats.duplicated_tokens and not base.header.stats.cross_edges
    validate_plan(crossing, forest)
    for r in range(2):
        validate_slice(slice_plan(crossing, r))
        check_rank(crossing.header, crossing.ranks[r])
    batch, batch_loss = _one_process(base, aux_loss_coef=0.0)
    got, got_loss = _one_process(crossing, aux_loss_coef=0.0, reach_all_units=True)  # both ranks here (LocalTransport)
    rel = rel_grad_diff(got, batch)
    print(f"the planner's crossing plan vs the plan without crossing windows, one process: {rel:.3g}")
    assert rel <= 1e-6 and abs(got_loss - batch_loss) <= 1e-6 * max(1.0, abs(batch_loss))
    want, loss = _one_process(crossing, reach_all_units=True)
    out = _spawn(2, crossing, "fsdp", 2)
    assert_ranks_match(out, want, loss, f"the planner's plan, 2 ranks ({_shape(crossing)})")
    posted = {r: sum(out[r]["batches"]) for r in range(2)}
    assert posted == {r: 2 * st.cross_edges for r in range(2)}, posted  # exports and gradients of every edge
