"""Ingestion benchmark: rollout batch bytes -> validated prefix Forest.

Run: `.venv/bin/python -m benchmarks.bench_forest [--quick] [--reps 3]`.

64 trajectories x 16,384 tokens in one tree sharing an 8,192-token prefix: JSON and protobuf
bytes -> Forest, validation included, Numba radix builder against the plain-Python reference,
and the radix merge alone. Target: under 1 s per batch including validation. `--quick` shrinks the
workload 16x (benchmarks/README.md, "Smaller benchmarks").
"""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np

from harts_client.timing import repeat, timed
from planner_service.ingest import forest_from_json, forest_from_proto, json_to_proto, warmup
from planner_service.ingest.radix import radix_forest
from planner_service.ingest.radix_ref import radix_forest_reference

log = logging.getLogger(__name__)


def workload(*, trajectories: int, length: int, prefix: int, vocab: int = 151_936, seed: int = 0) -> dict:
    """JSON document: `trajectories` of `length` tokens sharing their first `prefix` tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix)
    trajs = []
    for t in range(trajectories):
        suffix = rng.integers(0, vocab, length - prefix)
        trajs.append({
            "id": f"traj-{t}",
            "tree_id": "task-0",
            "tokens": np.concatenate([shared, suffix]).tolist(),
            "loss_mask": [0] * prefix + [1] * (length - prefix),
            "old_logprobs": (-rng.random(length, dtype=np.float32)).tolist(),
            "advantage": float(rng.standard_normal()),
        })
    return {"batch_id": "bench-forest", "vocab_size": vocab, "trajectories": trajs}


def run(quick: bool = False, reps: int = 3) -> dict:
    """Run the benchmark; returns the figures (seconds, sizes)."""
    shape = dict(trajectories=64, length=16_384, prefix=8_192)
    if quick:
        shape = dict(trajectories=16, length=4_096, prefix=2_048)
        reps = 1
    _, seconds = timed(warmup)
    log.info("numba warm-up: %.3f s", seconds)
    doc = workload(**shape)
    json_bytes = json.dumps(doc).encode()
    proto_bytes = json_to_proto(doc).SerializeToString()
    log.info("workload %s: JSON %.1f MB, protobuf %.1f MB", shape, len(json_bytes) / 1e6, len(proto_bytes) / 1e6)

    forest = forest_from_json(json_bytes)
    stats = forest.stats()
    out = {"workload": shape, "json_mb": len(json_bytes) / 1e6, "proto_mb": len(proto_bytes) / 1e6,
           "expanded_tokens": stats["expanded_tokens"], "unique_tokens": stats["unique_tokens"],
           "segments": stats["segments"], "compression": stats["compression"]}
    cases = {
        "json_numba_s": lambda: forest_from_json(json_bytes),
        "proto_numba_s": lambda: forest_from_proto(proto_bytes),
        "json_python_s": lambda: forest_from_json(json_bytes, numba=False),
        "proto_python_s": lambda: forest_from_proto(proto_bytes, numba=False),
    }
    for name, fn in cases.items():
        out[name] = repeat(fn, reps if "numba" in name else 1).median()
        log.info("%-15s %.3f s", name, out[name])

    lengths = np.full(shape["trajectories"], shape["length"], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([np.asarray(t["tokens"], np.int32) for t in doc["trajectories"]])
    tree = np.zeros(shape["trajectories"], np.int32)
    out["radix_numba_s"] = repeat(lambda: radix_forest(tokens, offsets, tree, 1), reps).median()
    out["radix_python_s"] = repeat(lambda: radix_forest_reference(tokens, offsets, tree, 1), 1).median()
    log.info("radix merge alone: numba %.4f s, python %.3f s", out["radix_numba_s"], out["radix_python_s"])
    out["target_met"] = max(out["json_numba_s"], out["proto_numba_s"]) < 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16x smaller workload (smoke run)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per case (median)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(json.dumps(run(quick=args.quick, reps=args.reps), indent=1))


if __name__ == "__main__":
    main()
