"""Per-rank peak parameter + gradient bytes with FSDP2: sharded through the step vs gathered for the step.

Run: `.venv/bin/python -m benchmarks.bench_fsdp_memory [--world-size 4] [--layers 16] [--out DIR]`
(progress on stderr, one JSON object on stdout; with --out also `fsdp_memory.md` and
`fsdp_memory.json` there). A benchmark, not a timed test: it measures bytes, not seconds.

One step on gloo ranks of one machine, of a model whose parameters dominate its activations,
`reshard_after_forward` true (`sharded`) and false (`gathered`) on the same lock-step plan, each
rank measuring `peak_param_grad_bytes` with the trainer's gauge (benchmarks/README.md, "Parameter +
gradient bytes per rank with FSDP2").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue as queue_mod
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harts_client.synthetic import generate
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from proto.arrays import pack
from proto.harts.v1 import plan_pb2
from trainer.config import ParallelismSection
from trainer.distributed import DistContext
from trainer.executor import Executor, ExecutorConfig
from trainer.models.config import FULL, LINEAR, ModelConfig
from trainer.models.materialize import materialize, meta_model, seed_rows
from trainer.param_memory import ParamGradGauge
from trainer.parallelize import GradSync, make_mesh, parallelize, run_slice

log = logging.getLogger("bench_fsdp_memory")

C = 16


def model_config(layers: int):
    """The benchmark model: parameters dominate (16 experts of width 64 per layer), vocabulary 256."""
    return ModelConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=layers, layer_types=[FULL if i % 4 == 3 else LINEAR for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=256, num_experts=16, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )


def lockstep_without_windows(plan):
    """A plan without windows as a lock-step plan: every rank FORWARD m, BACKWARD m per microbatch,
    shorter ranks padded with paired stand-ins (FORWARD k, BACKWARD k) to the longest."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    n = max(len(r.microbatches) for r in out.ranks)
    out.header.params.lockstep = True
    out.header.lockstep_phases = pack(np.array([plan_pb2.PHASE_FORWARD, plan_pb2.PHASE_BACKWARD] * n, np.uint8), "uint8")
    for r in out.ranks:
        del r.steps[:]
        for i in range(n):
            mb, k = (i, 0) if i < len(r.microbatches) else (-1, i + 1)
            r.steps.add(kind=plan_pb2.ExecStep.FORWARD, microbatch=mb, standin=k)
            r.steps.add(kind=plan_pb2.ExecStep.BACKWARD, microbatch=mb, standin=k)
    return out


def make_plan(world: int, tasks: int):
    doc = generate(scheme="tree", tasks=tasks, seed=1, scale=0.01, turns=(2, 3), old_logprobs=True)
    free = plan_step(forest_from_json(doc), PlanConfig(world_size=world, microbatch_tokens=128, chunk_size=C, windows=False))
    return lockstep_without_windows(free)


def _worker(rank: int, world: int, port: int, layers: int, plan_bytes: bytes, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank=rank, world_size=world, initialized=True)
        plan = plan_pb2.Plan.FromString(plan_bytes)
        slice_ = plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[rank])
        cfg = model_config(layers)
        out = {}
        for mode, reshard in (("sharded", True), ("gathered", False)):
            pcfg = ParallelismSection(reshard_after_forward=reshard)
            model = parallelize(meta_model(cfg), make_mesh(pcfg, ctx), pcfg, ctx, reshard=reshard)
            materialize(model, ctx.device, seed_rows(cfg, seed=0))
            gauge = ParamGradGauge(model)
            sync = GradSync(model, ctx, every_backward=reshard)
            ex = Executor(model, ExecutorConfig(chunk_size=C, reach_all_units=True))
            t0 = time.perf_counter()
            gauge.begin_step()
            res = run_slice(ex, slice_, sync)
            sync.finish_step(list(model.parameters()))
            gauge.sample()
            out[mode] = {"peak_param_grad_bytes": gauge.peak, "seconds": time.perf_counter() - t0,
                         "microbatches": res.microbatches, "standins": res.standins}
            gauge.remove()
            del model, gauge, sync, ex
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def run(quick: bool = False, *, world: int = 4, layers: int = 16, tasks: int = 4) -> dict:
    """Spawn the ranks, collect their peaks, and compare with the full model and the goal
    (`quick`: 8 layers, 2 tasks; the benchmarks' component contract)."""
    if quick:
        layers, tasks = min(layers, 8), min(tasks, 2)
    plan = make_plan(world, tasks)
    cfg = model_config(layers)
    meta = meta_model(cfg)
    unit_bytes = [2 * 4 * sum(p.numel() for p in b.parameters()) for b in meta.model.layers]
    block_ids = {id(p) for b in meta.model.layers for p in b.parameters()}
    unit_bytes.append(2 * 4 * sum(p.numel() for p in meta.parameters() if id(p) not in block_ids))  # the root
    full = 2 * 4 * sum(p.numel() for p in meta.parameters())
    log.info("model: %d layers, %.2f M parameters, full parameters + gradients %.1f MiB; plan: %s microbatches per rank",
             layers, full / 8 / 1e6, full / 2**20, [len(r.microbatches) for r in plan.ranks])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, layers, plan.SerializeToString(), q)) for r in range(world)]
    for p in procs:
        p.start()
    ranks: dict[int, dict] = {}
    while len(ranks) < world:
        try:
            r, got = q.get(timeout=5)
            ranks[r] = got
            log.info("rank %d done: %s", r, got)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(60)
    goal = full / world + 3 * max(unit_bytes)
    result = {"world_size": world, "layers": layers, "parameters": full // 8, "full_param_grad_bytes": full,
              "unit_param_grad_bytes_max": max(unit_bytes), "goal_bytes": goal}
    for mode in ("sharded", "gathered"):
        peak = max(ranks[r][mode]["peak_param_grad_bytes"] for r in range(world))
        result[mode] = {"peak_param_grad_bytes": peak, "fraction_of_full": peak / full,
                        "per_rank": [ranks[r][mode]["peak_param_grad_bytes"] for r in range(world)],
                        "standins": sum(ranks[r][mode]["standins"] for r in range(world))}
    result["sharded"]["meets_goal"] = result["sharded"]["peak_param_grad_bytes"] <= goal
    return result


def markdown(r: dict) -> str:
    mib = 2.0**20
    lines = [
        "# FSDP2 peak parameter + gradient bytes per rank",
        "",
        f"`python -m benchmarks.bench_fsdp_memory --world-size {r['world_size']} --layers {r['layers']}`: one step on "
        f"{r['world_size']} gloo ranks, {r['parameters'] / 1e6:.2f} M parameters; full parameters + gradients "
        f"{r['full_param_grad_bytes'] / mib:.2f} MiB, largest unit {r['unit_param_grad_bytes_max'] / mib:.2f} MiB "
        f"(parameters + gradients); goal full / W + 3 units = {r['goal_bytes'] / mib:.2f} MiB.",
        "",
        "| reshard_after_forward | peak_param_grad_bytes (max over ranks) | / full | per rank (MiB) |",
        "|---|---|---|---|",
    ]
    for mode, flag in (("sharded", "true (lock-step)"), ("gathered", "false")):
        m = r[mode]
        lines.append(f"| {flag} | {m['peak_param_grad_bytes'] / mib:.2f} MiB | {m['fraction_of_full']:.3f} | "
                     f"{', '.join(f'{b / mib:.2f}' for b in m['per_rank'])} |")
    lines += ["", f"Sharded meets the goal: {'yes' if r['sharded']['meets_goal'] else 'no'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_fsdp_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the model (default 16)")
    p.add_argument("--tasks", type=int, default=4, help="synthetic tasks (trees) of the step (default 4)")
    p.add_argument("--out", type=Path, default=None, help="write fsdp_memory.md and fsdp_memory.json here")
    args = p.parse_args(argv)
    if args.world_size < 1 or args.layers < 1 or args.tasks < 1:
        p.error(f"--world-size, --layers, --tasks: expected >= 1, got {args.world_size}, {args.layers}, {args.tasks}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    result = run(world=args.world_size, layers=args.layers, tasks=args.tasks)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fsdp_memory.json").write_text(json.dumps(result, indent=1))
        (args.out / "fsdp_memory.md").write_text(markdown(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
