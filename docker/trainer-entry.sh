#!/bin/sh
# Trainer container entry point: HARTS_NPROC data-parallel ranks under torchrun (`trainer.train`)
# that long-poll their slices of the steps step-0, step-1, ... (the generator's batch ids) and train.
#   HARTS_PLANNER_URL, HARTS_TOKEN (read by trainer.train), HARTS_STEPS (default 3), HARTS_NPROC
#   (default 2), HARTS_MODEL (tiny or a Qwen3-Next HF directory), HARTS_CHUNK_SIZE (must equal the
#   planner's), HARTS_BACKEND (ref | triton), HARTS_CHECKPOINT_DIR (default /ckpt: DCP checkpoints
#   every step, --resume after a restart, metrics.jsonl). Extra arguments are passed through.
set -eu
ckpt="${HARTS_CHECKPOINT_DIR:-/ckpt}"
exec torchrun --nproc_per_node="${HARTS_NPROC:-2}" --standalone -m trainer.train \
    --planner-url "${HARTS_PLANNER_URL:-http://planner:8000}" --steps "${HARTS_STEPS:-3}" --step-prefix step- \
    --model "${HARTS_MODEL:-tiny}" --chunk-size "${HARTS_CHUNK_SIZE:-64}" --backend "${HARTS_BACKEND:-ref}" \
    --checkpoint-dir "$ckpt" --checkpoint-every 1 --resume --metrics-jsonl "$ckpt/metrics.jsonl" "$@"
