"""Load benchmark of the planner service on loopback (a real `harts serve` subprocess).

    python -m benchmarks.bench_service [--quick]

Three phases, bounded in count and time: protobuf ingest, a submit-and-poll pipeline whose every
slice is checked and fetched twice, and ready-plan latency. Targets: protobuf ingest >= 100 MB/s;
p99 fetch latency of a ready plan <= 50 ms with 32 pollers (benchmarks/README.md, "Smaller
benchmarks").
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import json
import logging
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from harts_client.synthetic import generate
from harts_client.timing import Stopwatch, timed
from planner_service.ingest import json_to_proto
from planner_service.server import ServerProcess
from plan.seal import open_sealed

log = logging.getLogger("bench_service")

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _batches(prefix: str, count: int, *, tasks: int, scale: float, seed0: int) -> list[bytes]:
    out = []
    for i in range(count):
        doc = generate("group", tasks, seed0 + i, scale, old_logprobs=True)
        doc["batch_id"] = f"{prefix}-{i}"
        out.append(json_to_proto(doc).SerializeToString(deterministic=True))
    return out


def _submit_all(url: str, bodies: list[bytes], generators: int, params: dict | None = None) -> tuple[float, list[float]]:
    """Submit `bodies` from `generators` threads; returns (wall seconds, per-request seconds)."""
    latencies: list[float] = []
    lock = threading.Lock()
    chunks = [bodies[g::generators] for g in range(generators)]

    def worker(mine: list[bytes]) -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            for body in mine:
                r, dt = timed(c.post, "/v1/steps", content=body, headers=PROTOBUF, params=params or {})
                if r.status_code != 200:
                    raise RuntimeError(f"submit failed: {r.status_code} {r.text[:300]}")
                with lock:
                    latencies.append(dt)

    with Stopwatch() as sw, ThreadPoolExecutor(generators) as pool:
        list(pool.map(worker, chunks))
    return sw.wall, latencies


async def _poll_pipeline(url: str, steps: list[str], world: int, trainers: int, timeout: float) -> dict:
    """M trainer pollers long-poll every (step, rank); verify, refetch, compare."""
    jobs = [(s, r) for s in steps for r in range(world)]
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    fetched: list[tuple[str, int, str]] = []
    bad: list[str] = []

    async def trainer(client: httpx.AsyncClient) -> None:
        while True:
            try:
                step, rank = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            deadline = time.monotonic() + timeout
            while True:
                r = await client.get(f"/v1/steps/{step}/ranks/{rank}/plan", params={"wait": 10})
                if r.status_code != 404 or time.monotonic() > deadline:  # 404: not planned yet
                    break
            if r.status_code != 200:
                bad.append(f"{step}/{rank}: {r.status_code} {r.text[:200]}")
                continue
            sl = open_sealed(r.content)
            again = await client.get(f"/v1/steps/{step}/ranks/{rank}/plan")
            if again.content != r.content or r.headers["x-harts-checksum"] != sl.checksum:
                bad.append(f"{step}/{rank}: bytes differ on retry")
            if sl.header.step_id != step or sl.rank.rank != rank:
                bad.append(f"{step}/{rank}: got {sl.header.step_id}/{sl.rank.rank}")
            fetched.append((step, rank, sl.checksum))

    limits = httpx.Limits(max_connections=trainers, max_keepalive_connections=trainers)
    async with httpx.AsyncClient(base_url=url, timeout=timeout + 30, limits=limits) as client:
        await asyncio.gather(*(trainer(client) for _ in range(trainers)))
    keys = [(s, r) for s, r, _ in fetched]
    return {
        "slices_expected": len(jobs),
        "slices_fetched": len(fetched),
        "duplicates": len(keys) - len(set(keys)),
        "lost": len(set(jobs) - set(keys)),
        "errors": bad[:10],
        "intact": not bad and sorted(keys) == sorted(jobs),
    }


def _poller(url: str, targets: list[tuple[str, int]], picks: list[int], barrier, out) -> None:
    """One trainer-rank-like process: sequential fetches of ready slices, latency per fetch."""
    lat = []
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/healthz")  # connect before the clock starts
        barrier.wait()
        for i in picks:
            step, rank = targets[i]
            r, dt = timed(client.get, f"/v1/steps/{step}/ranks/{rank}/plan")
            lat.append(dt)
            if r.status_code != 200:
                lat.append(float("nan"))
    out.put(lat)


def _ready_latency(url: str, steps: list[str], pollers: int, per_poller: int) -> list[float]:
    """`pollers` concurrent processes, one per rank of `pollers`-rank plans (trainer ranks are
    processes), each fetching its rank's slice of randomly chosen ready steps."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(pollers), ctx.Queue()
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(steps), size=(pollers, per_poller)).tolist()
    procs = [ctx.Process(target=_poller, args=(url, [(s, p) for s in steps], picks[p], barrier, out))
             for p in range(pollers)]
    for proc in procs:
        proc.start()
    lat = [x for _ in procs for x in out.get(timeout=300)]
    for proc in procs:
        proc.join()
    if any(np.isnan(lat)):
        raise RuntimeError("a fetch of a ready plan failed")
    return lat


def _buckets(metrics: str, operation: str) -> dict[float, float]:
    prefix = "harts_request_seconds_bucket{"
    out = {}
    for line in metrics.splitlines():
        if line.startswith(prefix) and f'operation="{operation}"' in line and 'transport="http"' in line:
            out[float(line.split('le="')[1].split('"')[0])] = float(line.split()[-1])
    return out


def _server_quantile(before: str, after: str, operation: str, q: float) -> float | None:
    """Upper bucket bound (seconds) of the q-quantile of the server-side latency of `operation`
    between two /metrics snapshots."""
    b, a = _buckets(before, operation), _buckets(after, operation)
    rows = sorted((le, a[le] - b.get(le, 0.0)) for le in a)
    if not rows or rows[-1][1] <= 0:
        return None
    for le, count in rows:
        if count >= q * rows[-1][1]:
            return le
    return None


def run(quick: bool = False) -> dict:
    """Run the three phases; returns the figures (and prints progress on stderr)."""
    gens, trainers, pollers = 4, 4, 32
    n_ingest, n_pipe, n_ready, tasks, scale, per_poller = (12, 6, 2, 4, 0.1, 20) if quick else (32, 8, 4, 8, 0.25, 10)
    world = 2
    # memory budget large enough for the longest group rollouts at this scale (else planning fails)
    topo = {"world_size": world, "microbatch_tokens": 8192, "memory_tokens": 1 << 22, "chunk_size": 64}
    t_start = time.perf_counter()
    print(f"[bench_service] generating {n_ingest + n_pipe} batches ...", file=sys.stderr, flush=True)
    ingest_bodies = _batches("ingest", n_ingest, tasks=tasks, scale=scale, seed0=0)
    pipe_bodies = _batches("pipe", n_pipe, tasks=tasks, scale=scale, seed0=1000)
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(Path(tmp) / "bench.db", extra=["--max-wait", "30"]).start()
        try:
            url = srv.http_url
            ingest = _ingest_phase(url, ingest_bodies, gens)
            pipeline = _pipeline_phase(url, pipe_bodies, topo, gens, trainers)
            latency, metrics = _fetch_phase(url, [f"ingest-{i}" for i in range(n_ready)], topo, pollers, per_poller)
        finally:
            srv.stop()
    plan_count = [line for line in metrics.splitlines() if line.startswith("harts_plan_seconds_count")]
    plan_sum = [line for line in metrics.splitlines() if line.startswith("harts_plan_seconds_sum")]
    result = {
        "quick": quick,
        "ingest": ingest,
        "pipeline": pipeline,
        "fetch_ready": latency,
        "plan_seconds_mean": round(float(plan_sum[0].split()[-1]) / max(float(plan_count[0].split()[-1]), 1), 3)
        if plan_count and plan_sum else None,
        "targets": {
            "protobuf_ingest_mb_per_s>=100": ingest["protobuf_ingest_mb_per_s"] >= 100,
            "p99_fetch_ms<=50@32": latency["p99_ms"] <= 50,
            "all_plans_intact": pipeline["intact"],
        },
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return result


def _ingest_phase(url: str, bodies: list[bytes], gens: int) -> dict:
    """Submissions only: `gens` generators submit every batch."""
    mb = sum(map(len, bodies)) / 1e6
    print(f"[bench_service] ingest: {len(bodies)} batches, {mb:.1f} MB, {gens} generators", file=sys.stderr, flush=True)
    wall, sub_lat = _submit_all(url, bodies, gens)
    ingest = {
        "batches": len(bodies),
        "mb": round(mb, 2),
        "seconds": round(wall, 3),
        "submissions_per_s": round(len(bodies) / wall, 2),
        "protobuf_ingest_mb_per_s": round(mb / wall, 1),
        "submit_p50_ms": round(float(np.percentile(sub_lat, 50)) * 1e3, 1),
    }
    print(f"[bench_service] ingest: {ingest}", file=sys.stderr, flush=True)
    return ingest


def _pipeline_phase(url: str, bodies: list[bytes], topo: dict, gens: int, trainers: int) -> dict:
    """Generators submit steps with a topology while trainers long-poll their rank's plans."""
    n_pipe, world = len(bodies), topo["world_size"]
    steps = [f"pipe-{i}" for i in range(n_pipe)]
    print(f"[bench_service] pipeline: {n_pipe} steps x {world} ranks, {gens} generators, {trainers} trainers",
          file=sys.stderr, flush=True)
    with Stopwatch() as sw:
        sub = threading.Thread(target=_submit_all, args=(url, bodies, gens, topo))
        sub.start()
        pipeline = asyncio.run(_poll_pipeline(url, steps, world, trainers, timeout=120))
        sub.join()
    pipeline["seconds"] = round(sw.wall, 3)
    pipeline["steps_per_s"] = round(n_pipe / pipeline["seconds"], 2)
    print(f"[bench_service] pipeline: {pipeline}", file=sys.stderr, flush=True)
    return pipeline


def _fetch_phase(url: str, ready: list[str], topo: dict, pollers: int, per_poller: int) -> tuple[dict, str]:
    """Fetch latency of plans already made, `pollers` ranks; returns the figures and the server's metrics."""
    print(f"[bench_service] ready-plan fetch: planning {len(ready)} steps for {pollers} ranks", file=sys.stderr, flush=True)
    with httpx.Client(base_url=url, timeout=600) as c:
        for step in ready:
            r = c.post(f"/v1/steps/{step}/plan", json={**topo, "world_size": pollers})
            if r.status_code != 200:
                raise RuntimeError(f"plan failed: {r.status_code} {r.text[:300]}")
    targets = [(s, r) for s in ready for r in range(pollers)]
    before = httpx.get(f"{url}/metrics").text
    lat = _ready_latency(url, ready, pollers, per_poller)
    latency = {
        "pollers": pollers,
        "fetches": len(lat),
        "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
        "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2),
        "slice_kb": round(float(np.mean([len(httpx.get(f"{url}/v1/steps/{s}/ranks/{r}/plan").content)
                                         for s, r in targets[:: max(1, len(targets) // 8)]])) / 1e3, 1),
    }
    metrics = httpx.get(f"{url}/metrics").text
    server_p99 = _server_quantile(before, metrics, "fetch_plan", 0.99)
    latency["server_p99_ms_at_most"] = None if server_p99 is None else server_p99 * 1e3
    print(f"[bench_service] ready-plan fetch: {latency}", file=sys.stderr, flush=True)
    return latency, metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer and smaller batches")
    args = p.parse_args(argv)
    print(json.dumps(run(quick=args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
