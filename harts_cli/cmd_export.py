"""Export a training checkpoint as a Hugging Face Qwen3-Next directory for vLLM / SGLang / transformers.

    harts export ckpt/step-00000004 --out hf/step-4
    harts export ckpt --out hf/latest --dtype float32      # a checkpoint root: its newest checkpoint

Reads the sharded DCP checkpoint (saved at any world size) in this process and writes
`config.json`, sharded safetensors in the Qwen3-Next layout and `harts.json` with the policy
version (the number of completed trainer steps). See `trainer/export.py`.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (step-XXXXXXXX) or a checkpoint root with `latest`")
    parser.add_argument("--out", required=True, help="output directory (created; replaced if it exists)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="dtype of the written weights (default: bfloat16)")
    parser.add_argument("--max-shard-mb", type=int, default=2048, help="size limit of one safetensors shard in MiB")


def run(args: argparse.Namespace) -> int:
    from trainer.checkpoint import CheckpointError
    from trainer.export import DTYPES, META, export_checkpoint

    if args.max_shard_mb < 1:
        raise ValueError(f"--max-shard-mb: expected >= 1, got {args.max_shard_mb}")
    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=DTYPES[args.dtype], max_shard_bytes=args.max_shard_mb << 20)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    meta = json.loads((out / META).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    print(json.dumps({"out": str(out), "policy_version": meta["policy_version"], "shards": len(shards), "dtype": args.dtype}))
    return 0
