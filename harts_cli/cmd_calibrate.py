"""Measure the planner's cost model on the trainer: time the executor, fit the coefficients.

    harts calibrate --model tiny --chunk-size 16 -o cost.json
    harts plan rollouts.json --world-size 8 --cost-model cost.json       # placement balances seconds

Times synthetic batches on `Executor.run_step`, fits the four coefficients by non-negative least
squares (R^2 on held-out batches), then measures `transfer_byte` through the trainer's
point-to-point backend; prints the fit, `-o` writes `harts.cost_model.v1`. How: README.md ("What
`harts plan`, `harts verify` and `harts calibrate` print"); the model: docs/design/planner.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import socket
import time

import numpy as np

from harts_client.timing import repeat
from proto.arrays import unpack

log = logging.getLogger(__name__)

#: batch shapes the synthetic samples cycle through
SHAPES = ("chain", "branches", "nested", "flat")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="named model config or checkpoint directory (trainer.models.build_model)")
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size C of the plans (the kernel's)")
    p.add_argument("--samples", type=int, default=36, help="synthetic batches timed (default 36)")
    p.add_argument("--held-out", type=float, default=0.25, help="fraction of the batches kept out of the fit (default 0.25)")
    p.add_argument("--max-rows", type=int, default=4096, help="largest batch in tokens (default 4096)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch after one warm-up; the fastest counts")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads while timing (0: torch's default)")
    p.add_argument("--backend", default="auto", help="kernel backend of the chunked gated delta rule: auto (ref on the CPU, triton on CUDA) | ref | triton")
    p.add_argument("--device", default="cpu", help="torch device of the model")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches and the weights")
    p.add_argument("--transfer-backend", default="auto", choices=("auto", "gloo", "nccl", "none"),
                   help="backend whose point-to-point bandwidth gives transfer_byte (auto: gloo on the CPU, "
                        "nccl with --device cuda; none: skip)")
    p.add_argument("--transfer-max-mb", type=float, default=64.0,
                   help="largest buffer of the bandwidth measurement in MiB (default 64)")
    p.add_argument("-o", "--output", help="write the cost model JSON here")


def synthetic_batch(rng: np.random.Generator, shape: str, tokens: int, vocab: int, loss_density: float, name: str,
                    chunk: int = 64) -> dict:
    """A rollout batch (the JSON input format) of about `tokens` distinct tokens in one tree shape
    (SHAPES); `chunk` is the plans' chunk size, which nested branches must cross to need calls."""
    trajs = []

    def traj(toks: list[int], tree: str) -> None:
        mask = (rng.random(len(toks)) < loss_density).astype(int).tolist()
        trajs.append({"id": f"{tree}-{len(trajs)}", "tree_id": tree, "tokens": toks, "loss_mask": mask,
                      "advantage": float(rng.standard_normal())})

    def draw(n: int) -> list[int]:
        return rng.integers(0, vocab, size=max(1, n)).tolist()

    if shape == "chain":  # a few long trajectories: attention grows with depth
        for i in range(int(rng.integers(1, 3))):
            traj(draw(tokens // 2), f"c{i}")
    elif shape == "branches":  # a prompt and many branches at unaligned depths: replay
        prompt = draw(int(tokens * rng.uniform(0.1, 0.5)))
        rest = tokens - len(prompt)
        k = int(rng.integers(4, 24))
        for b in range(k):
            cut = int(rng.integers(len(prompt) // 2, len(prompt) + 1))
            traj(prompt[:cut] + [b % vocab] + draw(rest // k), "b")
    elif shape == "nested":  # branches inside branches about a chunk apart: sequential calls
        levels = int(rng.integers(2, 6))
        leaves = 2 ** levels
        heads = [draw(int(rng.integers(chunk // 2 + 1, 2 * chunk))) for _ in range(2 * leaves)]
        step = max(1, tokens // (2 * leaves))
        for leaf in range(leaves):
            path: list[int] = []
            for lv in range(levels):
                node = (1 << lv) + (leaf >> (levels - lv))  # one shared run per tree node
                path += [((leaf >> (levels - 1 - lv)) & 1) + 2 * lv] + heads[node % len(heads)]
            traj(path + draw(step), "n")
    else:  # many short independent trajectories: shallow attention
        n = int(rng.integers(8, 40))
        for i in range(n):
            traj(draw(tokens // n), f"f{i}")
    return {"batch_id": name, "vocab_size": vocab, "trajectories": trajs}


def plan_features(plan) -> np.ndarray:
    """float64 [4] summed cost features of a plan's microbatches (cost_model.FEATURES order)."""
    from planner_service.planner.cost_model import microbatch_features  # optional: numba (harts_cli/main.py)

    total = np.zeros(4)
    for rank in plan.ranks:
        for mb in rank.microbatches:
            depth = unpack(mb.depth, "int32")
            # replay rows (local or imported from a window parent) sit at the depths before their range
            replay = [s.start_depth + np.arange(len(s.replay_rows) // 4) for c in mb.linear_calls for s in c.sequences]
            replay_depth = np.concatenate(replay).astype(np.int32) if replay else np.zeros(0, np.int32)
            total += microbatch_features(mb.num_rows, mb.replay_tokens, depth, replay_depth, len(mb.linear_calls),
                                         unpack(mb.lp_row, "int32"))
    return total


#: smallest buffer of the bandwidth measurement
TRANSFER_MIN_BYTES = 1 << 10


def _bounce(rank: int, port: int, backend: str, sizes: list[int], repeats: int, out) -> None:
    """One of the two measuring processes: rank 0 sends each buffer to rank 1, which sends it back
    (through `P2PTransport`, as the trainer does); rank 0 puts the fastest round trip per size on `out`."""
    # optional (harts_cli/main.py): torch and the trainer load only in the measuring processes
    import torch
    import torch.distributed as dist

    from plan.cross_edges import CrossEdgeArrays
    from trainer.cross_rank import P2PTransport, Transfer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        transport, best = P2PTransport(timeout_s=120.0), []
        edge = CrossEdgeArrays(id=0, exporter=0, exporter_rank=0, importer=1, importer_rank=1, rows={},
                               states=np.zeros(0, np.int64), send_phase=0, grad_phase=1, bytes=0)
        for n in sizes:
            buf = torch.zeros(n, dtype=torch.uint8, device=device)
            times = []
            for _ in range(repeats + 1):  # the first round warms the connection and the allocator
                t0 = time.perf_counter()
                for grad in (False, True):  # there and back
                    transport.run(int(grad), [Transfer(edge=edge, grad=grad, rank=rank, peer=1 - rank,
                                                       send=(rank == 0) != grad, buf=buf)])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            best.append(min(times[1:]))
        if rank == 0:
            out.put(best)
    finally:
        dist.destroy_process_group()


def measure_transfer(backend: str, max_bytes: int, repeats: int = 3) -> dict:
    """Point-to-point bandwidth of `backend` between two local processes (README.md, "What `harts plan`,
    `harts verify` and `harts calibrate` print").

    Returns:
        {"transfer_byte": seconds per byte, "bandwidth_gb_s", "latency_seconds", "backend",
         "sizes", "one_way_seconds"}.
    Raises:
        ValueError: max_bytes below 64 KiB, or NCCL without two CUDA devices.
    """
    # optional (harts_cli/main.py): torch loads only when this command runs
    import torch
    import torch.multiprocessing as mp

    if max_bytes < 64 * TRANSFER_MIN_BYTES:
        raise ValueError(f"--transfer-max-mb: expected >= 0.0625 (64 KiB), got {max_bytes / (1 << 20):g}")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError(f"--transfer-backend nccl: expected two CUDA devices, got {torch.cuda.device_count()}; "
                         "use --transfer-backend gloo or none")
    sizes = []
    n = TRANSFER_MIN_BYTES
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_bounce, args=(r, port, backend, sizes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rtt = out.get(timeout=600)
    except queue.Empty:
        raise ValueError(f"--transfer-backend {backend}: the measuring processes reported nothing in 600 s "
                         f"(exit codes {[p.exitcode for p in procs]}); see their errors above") from None
    finally:
        for p in procs:
            p.join(60)
            if p.exitcode is None:
                p.kill()
    one_way = np.array(rtt) / 2
    slope, latency = np.polyfit(np.array(sizes, np.float64), one_way, 1)
    slope = max(float(slope), 1e-15)
    return {"transfer_byte": slope, "bandwidth_gb_s": 1e-9 / slope, "latency_seconds": float(latency),
            "backend": backend, "sizes": sizes, "one_way_seconds": one_way.tolist()}


def fit_report(X: np.ndarray, t: np.ndarray, train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, float, dict]:
    """NNLS fit of step seconds t [n] = step overhead + X [n, 4] @ coefficients on the `train`
    rows, and its metrics on the held-out `test` rows.

    The step overhead (the executor's fixed cost per run_step, equal on every rank) is fitted
    too, so that it does not leak into the per-microbatch coefficients, but it is not part of the
    cost model: it cannot change which placement is faster.

    Returns:
        coefficients float64 [4], step overhead seconds, report dict.
    """
    from planner_service.planner.cost_model import nnls  # optional: numba (harts_cli/main.py)

    A = np.column_stack([X, np.ones(X.shape[0])])
    scale = A[train].max(axis=0)
    scale[scale == 0] = 1.0
    sol = nnls(A[train] / scale, t[train]) / scale
    coef, overhead = sol[:4], float(sol[4])

    def metrics(rows: np.ndarray) -> dict:
        pred = X[rows] @ coef + overhead
        resid = t[rows] - pred
        tot = float(((t[rows] - t[rows].mean()) ** 2).sum())
        return {"r2": 1.0 - float((resid ** 2).sum()) / tot if tot > 0 else 0.0,
                "max_rel_error": float(np.max(np.abs(resid) / t[rows])) if rows.size else 0.0,
                "mean_rel_error": float(np.mean(np.abs(resid) / t[rows])) if rows.size else 0.0}

    held, fitted = metrics(test), metrics(train)
    return coef, overhead, {**held, "r2_train": fitted["r2"], "max_rel_error_train": fitted["max_rel_error"],
                            "step_overhead_seconds": overhead}


def run(args: argparse.Namespace) -> int:
    # optional (harts_cli/main.py): the planner's and the trainer's extras load only when this command runs
    import torch

    from planner_service import ingest
    from planner_service.planner import warmup
    from planner_service.planner.cost_model import FEATURES, CostModel
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model

    if args.samples < 4:
        raise ValueError(f"--samples: expected >= 4 (a fit and a held-out set), got {args.samples}")
    if not 0 < args.held_out < 1:
        raise ValueError(f"--held-out: expected a fraction in (0, 1), got {args.held_out}")
    backend = args.transfer_backend if args.transfer_backend != "auto" else ("gloo" if args.device == "cpu" else "nccl")
    if backend != "none" and args.transfer_max_mb * (1 << 20) < 64 * TRANSFER_MIN_BYTES:
        raise ValueError(f"--transfer-max-mb: expected >= 0.0625 (64 KiB), got {args.transfer_max_mb:g}")
    t_start = time.perf_counter()
    ingest.warmup()
    warmup()
    torch.manual_seed(args.seed)
    model = build_model(args.model, seed=args.seed).to(args.device)
    ex = Executor(model, ExecutorConfig(chunk_size=args.chunk_size, backend=args.backend, validate="none"))
    rng = np.random.default_rng(args.seed)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        X, t = _time_batches(args, model, ex, rng)
    finally:
        torch.set_num_threads(threads)
    n_test = max(1, int(round(args.held_out * len(t))))
    order = rng.permutation(len(t))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    coef, _, report = fit_report(X, t, train, test)
    if coef[0] + coef[1] <= 0:
        log.warning("calibrate: the fit gives rows and attention no cost: these batches are too small to show "
                    "per-token work next to the fixed costs; raise --max-rows")
    report.update({
        "model": args.model, "device": args.device, "backend": args.backend, "threads": args.threads,
        "chunk_size": args.chunk_size, "samples": len(t), "held_out": int(n_test),
        "timed_plans": "one rank, sharing windows on",
        "feature_ranges": {name: [float(X[:, j].min()), float(X[:, j].max())] for j, name in enumerate(FEATURES)},
        "seconds_range": [float(t.min()), float(t.max())], "calibration_seconds": time.perf_counter() - t_start,
    })
    transfer = {}
    if backend != "none":
        log.info("calibrate: point-to-point bandwidth on %s (1 KiB .. %g MiB)", backend, args.transfer_max_mb)
        transfer = measure_transfer(backend, int(args.transfer_max_mb * (1 << 20)), repeats=args.repeats)
        report["transfer"] = transfer
        log.info("calibrate: %s: %.3g GB/s, latency %.3g ms", backend, transfer["bandwidth_gb_s"],
                 1e3 * transfer["latency_seconds"])
    cm = CostModel(**dict(zip(FEATURES, (float(c) for c in coef))), transfer_byte=transfer.get("transfer_byte"),
                   source=f"harts calibrate --model {args.model} ({args.device}, {args.backend}, C={args.chunk_size})",
                   fit=report)
    out = {"coefficients": dict(zip(FEATURES, coef.tolist())), "transfer_byte": cm.transfer_byte, **report}
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(cm.to_json() + "\n")
        out["output"] = args.output
        log.info("wrote %s", args.output)
    print(json.dumps(out))
    return 0


def _time_batches(args: argparse.Namespace, model, ex, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Plan and time `args.samples` synthetic batches (SHAPES in turn): their cost features
    float64 [n, 4] and step seconds float64 [n] (CPU: this process's CPU seconds, since other
    processes on a shared machine only add wall time; an accelerator: wall seconds after a synchronize)."""
    # optional (harts_cli/main.py): the planner's and the trainer's extras load only when this command runs
    import torch

    from planner_service import ingest
    from planner_service.planner import PlanConfig, plan_step

    vocab = model.config.vocab_size
    clock, sync = ("cpu", None) if args.device == "cpu" else ("wall", torch.cuda.synchronize)
    X, t = [], []
    for i in range(args.samples):
        shape = SHAPES[i % len(SHAPES)]
        tokens = int(np.exp(rng.uniform(np.log(max(args.chunk_size, 64)), np.log(args.max_rows))))
        doc = synthetic_batch(rng, shape, tokens, vocab, float(rng.uniform(0.1, 0.9)), f"calibrate-{i}", args.chunk_size)
        forest = ingest.forest_from_json(json.dumps(doc))
        # one microbatch, or a few joined by sharing windows (per-microbatch work shows in the call term)
        budget = forest.unique_tokens // int(rng.integers(1, 4)) + args.chunk_size
        plan = plan_step(forest, PlanConfig(world_size=1, microbatch_tokens=budget, chunk_size=args.chunk_size,
                                            conv_kernel=model.config.linear_conv_kernel_dim,
                                            model_config=model.config.to_hf_dict()))
        # the warm-up run warms caches and allocators
        best = repeat(lambda: ex.run_step(plan), args.repeats, warmup=1, sync=sync).fastest(clock).on(clock)
        model.zero_grad(set_to_none=True)
        X.append(plan_features(plan))
        t.append(best)
        log.info("calibrate: batch %d/%d (%s): %d rows, %.0f pairs, %d calls, %d log-prob rows: %.4f s",
                 i + 1, args.samples, shape, *X[-1].astype(int).tolist(), best)
    return np.array(X), np.array(t)
