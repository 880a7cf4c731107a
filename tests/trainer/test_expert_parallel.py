"""Expert parallelism (`trainer.expert_parallel`): each MoE layer's experts split over E ranks, tokens
sent to them and back by all-to-all, on gloo. A lock-step plan with windows and recomputation on 2
and 4 ranks, parameters sharded through the step (FSDP2 over "dp" for the experts, over all ranks
for the rest), must give the one-process step's gradients (relative difference <= 1e-6), loss and
expert loads; with full activation checkpointing too (the recomputed blocks' all-to-alls and
all-gathers pair up across ranks because every rank recomputes in the same phases); a sharded
checkpoint of the expert-parallel model loads back into a fresh one.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from proto.harts.v1 import plan_pb2
from tests.dist_helpers import assert_ranks_match, spawn_ranks
from tests.executor_helpers import lockstep_plan
from tests.trainer.test_lockstep import SEED, _executor, _free_plan, _one_process
from trainer.models import build_model

#: (world size, expert-parallel size, activation checkpointing)
CASES = [(2, 2, "none"), (4, 2, "full"), (4, 4, "none")]


def _worker(rank: int, world: int, port: int, args: tuple, queue) -> None:
    plan_bytes, ep, ckpt, ckpt_dir = args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from trainer.config import ParallelismSection
        from trainer.distributed import DistContext
        from trainer.parallelize import GradSync, make_mesh, parallelize, run_slice

        ctx = DistContext(rank=rank, world_size=world, initialized=True)
        cfg = ParallelismSection(reshard_after_forward=True, expert_parallel=ep, activation_checkpointing=ckpt)
        mesh = make_mesh(cfg, ctx)
        model = build_model("tiny", seed=SEED, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        plan = plan_pb2.Plan.FromString(plan_bytes)
        sync = GradSync(model, ctx, every_backward=True)
        res = run_slice(_executor(model, reach_all_units=True, activation_checkpointing=ckpt),
                        plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[rank]), sync)
        sync.finish_step(list(model.parameters()))
        grads = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        out = {"grads": grads, "loss": res.loss, "expert_load": res.expert_load,
               "local_experts": int(experts.to_local().shape[0]), "placements": str(experts.placements)}
        if ckpt_dir:  # a sharded checkpoint of the expert-parallel model, loaded into a fresh one
            from trainer import checkpoint
            from trainer.optim import make_optimizer

            opt = make_optimizer(list(model.parameters()), lr=1e-3)
            opt.step()
            path = checkpoint.save(ckpt_dir, step=1, model=model, optimizer=opt, meta={}, ctx=ctx)
            fresh = build_model("tiny", seed=SEED + 1, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
            checkpoint.load(path, model=fresh)
            out["weights"] = {n: p.detach().full_tensor().numpy().copy() for n, p in model.named_parameters()}
            out["reloaded"] = {n: p.detach().full_tensor().numpy().copy() for n, p in fresh.named_parameters()}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("world,ep,ckpt", CASES, ids=[f"W{w}-E{e}-{c}" for w, e, c in CASES])
def test_expert_parallel_step_equals_the_one_process_step(world, ep, ckpt, tmp_path):
    free = _free_plan(world)
    plan = lockstep_plan(free)
    ckpt_dir = str(tmp_path / "ckpt") if (world, ep) == (4, 2) else ""
    out = spawn_ranks(_worker, world, ((plan.SerializeToString(), ep, ckpt, ckpt_dir),))
    grads, loss = _one_process(free)
    assert_ranks_match(out, grads, loss, f"{world} ranks, E = {ep}, checkpointing {ckpt}")
    num_experts = build_model("tiny", seed=SEED).config.num_experts
    # each rank of a group holds num_experts / E experts, split again by FSDP2 over the W / E ranks holding
    # the same ones: every expert is stored exactly once
    assert sum(o["local_experts"] for o in out.values()) == num_experts
    assert all(o["local_experts"] == num_experts // world for o in out.values())
    ref = _executor(build_model("tiny", seed=SEED)).run_step(free)
    np.testing.assert_array_equal(sum(o["expert_load"] for o in out.values()), ref.expert_load)
    if ckpt_dir:  # the checkpoint gives back every rank's weights, experts across both mesh dims included
        for o in out.values():
            assert o["weights"].keys() == o["reloaded"].keys()
            for name, w in o["weights"].items():
                np.testing.assert_array_equal(o["reloaded"][name], w, err_msg=name)


def test_expert_parallelism_needs_fsdp_and_lockstep():
    from trainer.config import ParallelismSection

    with pytest.raises(ValueError, match="expert_parallel: expected 1 with data_parallel='replicate'"):
        ParallelismSection(data_parallel="replicate", expert_parallel=2)
    with pytest.raises(ValueError, match="expert_parallel: expected reshard_after_forward true or none"):
        ParallelismSection(expert_parallel=2, reshard_after_forward=False)
    with pytest.raises(ValueError, match="expert_parallel: expected >= 1"):
        ParallelismSection(expert_parallel=0)
