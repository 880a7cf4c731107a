"""Operations benchmark of the planner service: stored plan size, replica failover, replica throughput.

    python -m benchmarks.bench_replicas [--pg-url postgresql://...] [--quick]

Storage (12 x 100k tokens sharing 60k, planned at W = 8 into SQLite: stored bytes per submitted
byte against the sealed bytes trainers receive), failover (two `harts serve` replicas on one
PostgreSQL, one killed with SIGKILL, also mid-plan) and throughput with 1 and 2 replicas. Without
--pg-url a throwaway server starts from the Debian package (`benchmarks.postgres_server`). Prints
one JSON line per measurement and a markdown table (benchmarks/README.md, "Operations").
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.postgres_server import PostgresServer, find_binaries
from harts_client.client import PlannerClient, RetryPolicy
from harts_client.synthetic import generate
from planner_service.core import PlannerCore, ServiceConfig
from planner_service.server import ServerProcess
from proto.harts.v1 import planner_pb2

TOKEN = "bench-token"


def shared_prefix_batch(*, scale: float = 1.0) -> bytes:
    """12 trajectories of 100k tokens sharing a 60k prefix (explicit tree), as JSON."""
    rng = np.random.default_rng(0)
    vocab = 151936
    shared, own = int(60_000 * scale), int(40_000 * scale)
    nodes = [{"id": 0, "tokens": rng.integers(0, vocab, shared).tolist()}]
    nodes += [{"id": i + 1, "parent": 0, "tokens": rng.integers(0, vocab, own).tolist()} for i in range(12)]
    trajs = [{"id": f"t{i}", "node": i + 1, "advantage": float(rng.normal())} for i in range(12)]
    doc = {"batch_id": "prefix60", "vocab_size": vocab, "trees": [{"id": "task", "nodes": nodes, "trajectories": trajs}]}
    return json.dumps(doc, separators=(",", ":")).encode()


def bench_storage(scale: float) -> dict:
    body = shared_prefix_batch(scale=scale)
    with tempfile.TemporaryDirectory() as tmp:
        core = PlannerCore(ServiceConfig(db_path=f"{tmp}/s.db", slice_cache_bytes=0))
        core.start()
        try:
            core.submit(body, "json")
            t0 = time.perf_counter()
            core.plan("prefix60", planner_pb2.Topology(world_size=8))
            plan_s = time.perf_counter() - t0
            db = core.store._db
            stored = db.execute("SELECT SUM(LENGTH(data)), MAX(LENGTH(data)) FROM slices").fetchone()
            stored_body = db.execute("SELECT LENGTH(body) FROM bodies").fetchone()[0]
            t0 = time.perf_counter()
            sealed = [core.fetch("prefix60", r) for r in range(8)]
            read_s = time.perf_counter() - t0
        finally:
            core.close()
    raw = sum(map(len, sealed))
    return {"measure": "storage", "json_bytes": len(body), "sealed_bytes": raw, "stored_slice_bytes": stored[0],
            "largest_stored_slice": stored[1], "largest_sealed_slice": max(map(len, sealed)),
            "stored_body_bytes": stored_body, "sealed_per_input": raw / len(body),
            "stored_per_input": stored[0] / len(body), "plan_and_store_s": plan_s, "read_8_slices_s": read_s}


def _step(i: int) -> dict:
    doc = generate(scheme="tree", tasks=2, seed=i, scale=0.05, old_logprobs=True)
    doc["batch_id"] = f"bench-{i}"
    return doc


TOPO = {"world_size": 2, "microbatch_tokens": 1024, "chunk_size": 64}


def bench_failover(pg_url: str, kills: int, tmp: Path) -> dict:
    a = ServerProcess(pg_url, token=TOKEN, log_path=tmp / "a.log").start()
    b = ServerProcess(pg_url, token=TOKEN, log_path=tmp / "b.log", extra=["--plan-workers", "1"]).start()
    served, resumed = [], []
    try:
        for k in range(kills):
            with PlannerClient([a.http_url, b.http_url], token=TOKEN, retry=RetryPolicy(backoff_s=0.05)) as c:
                c.submit(_step(1000 + k), **TOPO)  # warm: the client talks to A
                c.fetch_plan_bytes(f"bench-{1000 + k}", 0, timeout=60)
                assert c.url == a.http_url
                a.kill()
                t0 = time.perf_counter()
                c.submit(_step(2000 + k), **TOPO)
                c.fetch_plan_bytes(f"bench-{2000 + k}", 1, timeout=60)
                served.append(time.perf_counter() - t0)
            # a plan requested from A that A never stores: B's orphan scan takes it over
            a.start()
            with PlannerClient(a.http_url, token=TOKEN) as ca, PlannerClient(b.http_url, token=TOKEN) as cb:
                sid = f"bench-{3000 + k}"
                ca.submit(_step(3000 + k))
                threading.Thread(target=lambda: _quiet(ca.plan, sid, timeout=2, **TOPO), daemon=True).start()
                time.sleep(0.05)  # A takes the planning lock
                a.kill()
                t0 = time.perf_counter()
                cb.fetch_plan_bytes(sid, 0, timeout=60)
                resumed.append(time.perf_counter() - t0)
            a.start()
    finally:
        a.kill()
        b.stop()
    return {"measure": "failover", "kills": kills, "next_plan_served_s_median": statistics.median(served),
            "next_plan_served_s_max": max(served), "orphaned_plan_served_s_median": statistics.median(resumed),
            "orphaned_plan_served_s_max": max(resumed)}


def _quiet(fn, *args, **kw) -> None:
    try:
        fn(*args, **kw)
    except Exception:
        pass  # the replica was killed under the request


def bench_throughput(pg_url: str, steps: int, tmp: Path) -> dict:
    docs = [_step(i) for i in range(2 * steps)]
    out = {"measure": "throughput", "steps": steps}
    for replicas in (1, 2):
        servers = [ServerProcess(pg_url, token=TOKEN, log_path=tmp / f"t{replicas}-{k}.log").start()
                   for k in range(replicas)]
        batch = docs[(replicas - 1) * steps:replicas * steps]
        try:
            t0 = time.perf_counter()

            def submit(k: int) -> None:
                urls = [s.http_url for s in servers]
                with PlannerClient(urls[k % replicas:] + urls[:k % replicas], token=TOKEN) as c:
                    for doc in batch[k::4]:
                        c.submit(doc, **TOPO)
                    for doc in batch[k::4]:
                        c.fetch_plan_bytes(doc["batch_id"], 0, timeout=300)

            threads = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[f"steps_per_s_{replicas}_replica{'s' if replicas > 1 else ''}"] = steps / (time.perf_counter() - t0)
        finally:
            for s in servers:
                s.stop()
    return out


def run(quick: bool = False, pg_url: str | None = None) -> dict:
    """The three measurements (benchmarks/README.md, "Operations") as {"storage": ..., "failover": ..., "throughput": ...}."""
    out = {"storage": bench_storage(0.1 if quick else 1.0)}
    print(json.dumps(out["storage"]), flush=True)
    server = None
    if pg_url is None:
        binaries = find_binaries()
        if binaries is None:
            raise SystemExit("bench_replicas: PostgreSQL binaries not found (apt-get install postgresql) and no --pg-url")
        server = PostgresServer(binaries).start()
        pg_url = server.url
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out["failover"] = bench_failover(pg_url, 2 if quick else 5, Path(tmp))
            print(json.dumps(out["failover"]), flush=True)
            out["throughput"] = bench_throughput(pg_url, 8 if quick else 24, Path(tmp))
            print(json.dumps(out["throughput"]), flush=True)
    finally:
        if server is not None:
            server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--pg-url", default=None, help="PostgreSQL database to use (default: a throwaway server)")
    p.add_argument("--quick", action="store_true", help="a tenth of the batch, 2 kills, 8 steps")
    args = p.parse_args(argv)
    res = run(args.quick, args.pg_url)
    s, f, t = res["storage"], res["failover"], res["throughput"]
    print(f"""
| measure | value |
| --- | --- |
| submitted JSON (12 x 100k tokens sharing 60k) | {s['json_bytes'] / 1e6:.2f} MB |
| sealed slices at W = 8 (what trainers receive) | {s['sealed_bytes'] / 1e6:.1f} MB ({s['sealed_per_input']:.1f}x) |
| stored slices | {s['stored_slice_bytes'] / 1e6:.2f} MB ({s['stored_per_input']:.2f}x the input) |
| stored body | {s['stored_body_bytes'] / 1e6:.2f} MB |
| failover: kill -9 of a replica to the next plan served | {f['next_plan_served_s_median']:.2f} s median, {f['next_plan_served_s_max']:.2f} s max ({f['kills']} kills) |
| failover: a plan in progress on the killed replica, served by the other | {f['orphaned_plan_served_s_median']:.2f} s median, {f['orphaned_plan_served_s_max']:.2f} s max |
| plan throughput, 1 replica | {t['steps_per_s_1_replica']:.2f} steps/s |
| plan throughput, 2 replicas on one PostgreSQL | {t['steps_per_s_2_replicas']:.2f} steps/s |
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
