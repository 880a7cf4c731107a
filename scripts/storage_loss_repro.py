"""Reproduce storage loss: delete the WAL or the database under a running `harts serve`, stop it
(kill -9 after a delay, or SIGTERM), restart it on the same path, count the acknowledged batches
that came back.

    .venv/bin/python scripts/storage_loss_repro.py                     # every variant, 10 batches each
    .venv/bin/python scripts/storage_loss_repro.py --delays 0.1 --batches 20 --only wal

Variants `rm db-wal` and `rm db db-wal db-shm`, each in a fresh database; a line per variant:
batches acknowledged, batches back, and whether the restarted service was ready (it is not on a
database that lacks acknowledged batches, until `--accept-data-loss`; docs/design/service.md).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner_service.server import ServerProcess  # noqa: E402
from tests.service_helpers import rollout_doc  # noqa: E402

FILES = {"wal": ("-wal",), "db": ("", "-wal", "-shm")}


def run_variant(folder: Path, files: tuple[str, ...], stop: str, delay: float, batches: int) -> dict:
    """One variant; returns what it saw."""
    db = folder / "repro.db"
    srv = ServerProcess(db, log_path=folder / "repro.log").start()
    acked = set()
    with httpx.Client(base_url=srv.http_url, timeout=30) as c:
        for i in range(batches):
            if c.post("/v1/steps", json=rollout_doc(f"b{i}", seed=i)).status_code == 200:
                acked.add(f"b{i}")
    for suffix in files:
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    time.sleep(delay)
    srv.kill(signal.SIGKILL if stop == "kill -9" else signal.SIGTERM)
    srv.start(ready=False)
    try:
        with httpx.Client(base_url=srv.http_url, timeout=30) as c:
            ready = c.get("/readyz")
            back = {s["step_id"] for s in c.get("/v1/steps", params={"limit": 1000}).json()["steps"]}
    finally:
        srv.stop()
    return {"acknowledged": len(acked), "back": len(acked & back), "ready": ready.status_code == 200,
            "reason": "" if ready.status_code == 200 else ready.json().get("reason", "")[:120]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", type=float, nargs="+", default=[0.1, 1.0, 2.0, 3.0],
                   help="seconds between the deletion and the kill -9")
    p.add_argument("--batches", type=int, default=10, help="acknowledged batches before the deletion")
    p.add_argument("--only", choices=sorted(FILES), default=None, help="one kind of deletion")
    args = p.parse_args(argv)
    rows = []
    for kind in [args.only] if args.only else sorted(FILES, reverse=True):
        plans = [("kill -9", d) for d in args.delays] + [("SIGTERM", min(args.delays))]
        for stop, delay in plans:
            with tempfile.TemporaryDirectory(prefix="harts-repro-") as tmp:
                seen = run_variant(Path(tmp), FILES[kind], stop, delay, args.batches)
            row = {"deleted": " ".join(f"db{s}" for s in FILES[kind]), "stop": stop, "after_s": delay, **seen}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lost = sum(r["acknowledged"] - r["back"] for r in rows)
    print(f"{len(rows)} variants, {sum(r['acknowledged'] for r in rows)} acknowledged batches, {lost} lost, "
          f"{sum(not r['ready'] for r in rows)} restarts not ready")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
