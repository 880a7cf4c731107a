"""Print the README's memory tables: bytes per row and rows per rank of the full-size named models
under each activation-checkpointing mode and expert parallelism (plan/cluster_memory.py).

    python scripts/memory_table.py [--microbatch-tokens 16384] [--device-memory-gb 141]

bf16 compute, C = 64, the GPU trainer's chunked lm head, lock-step FSDP2, a 10% margin: what
`harts plan --model M --world-size W --activation-checkpointing MODE --expert-parallel E` reports.
How the figures are made: docs/design/planner.md ("The memory budget M").
"""
from __future__ import annotations

import argparse

from plan.cluster_memory import GIB, memory_report
from plan.memory_model import CHECKPOINTING
from plan.named_models import NAMED_MODELS

#: the paper-scale models of the table (NAMED_MODELS also holds the one-GPU bench model)
MODELS = ("qwen3-next-80b-a3b", "hybrid-moe-124b")
WORLD_SIZES = (8, 32, 64)
EXPERT_PARALLEL = (1, 8)


def _row(r) -> str:
    split = f" ({r.kept_row_bytes / 1e6:.2f} + {r.recompute_row_bytes / 1e6:.2f})" if r.recompute_row_bytes else ""
    return f"{r.bytes_per_row / 1e6:.2f} MB{split}"


def _cell(r) -> str:
    if r.fits:
        return f"{r.activation_tokens:,}: fits"
    if r.static_bytes + r.margin_bytes > r.device_memory_bytes:
        return f"0: {(r.static_bytes + r.margin_bytes - r.device_memory_bytes) / GIB:.1f} GiB over before activations"
    return f"{r.activation_tokens:,}: {(r.microbatch_bytes - r.device_memory_bytes) / GIB:.1f} GiB short"


def tables(B: int, device_gb: float) -> list[str]:
    """The bytes-per-row table and the rows-per-rank table (module docstring)."""
    reports = {(name, W, E, mode): memory_report(config(), W, activation_checkpointing=mode, expert_parallel=E,
                                                 microbatch_tokens=B, device_memory_gb=device_gb, model_name=name)
               for name, config in ((n, NAMED_MODELS[n]) for n in MODELS) for W in WORLD_SIZES for E in EXPERT_PARALLEL
               for mode in CHECKPOINTING}
    out = ["| model | " + " | ".join(f"{mode}: bytes per row (kept + recompute)" for mode in CHECKPOINTING) + " |",
           "|---|" + "---|" * len(CHECKPOINTING)]
    for name in MODELS:
        out.append(f"| {name} | " + " | ".join(_row(reports[name, 32, 1, mode]) for mode in CHECKPOINTING) + " |")
    out += ["", "| model | W | E | shards + gathered units | " + " | ".join(
        f"{mode}: rows per rank, B = {B:,}" for mode in CHECKPOINTING) + " |", "|---|---|---|---|" + "---|" * len(CHECKPOINTING)]
    for name in MODELS:
        for W in WORLD_SIZES:
            for E in EXPERT_PARALLEL:
                r = reports[name, W, E, "none"]
                out.append(f"| {name} | {W} | {E} | {r.shard_bytes / GIB:.1f} + {r.gathered_bytes / GIB:.1f} GiB | "
                           + " | ".join(_cell(reports[name, W, E, mode]) for mode in CHECKPOINTING) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch-tokens", type=int, default=16384, help="rows B of one microbatch (default 16,384)")
    parser.add_argument("--device-memory-gb", type=float, default=141.0, help="GiB per device (default 141: an H200)")
    args = parser.parse_args()
    print("\n".join(tables(args.microbatch_tokens, args.device_memory_gb)))


if __name__ == "__main__":
    main()
