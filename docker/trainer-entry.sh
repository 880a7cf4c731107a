#!/bin/sh
# Trainer container entry point: 2 data-parallel ranks under torchrun that fetch their plan slices
# from the planner (trainer.client) and train. `trainer.train` is the trainer entry point (its CLI
# lands with the trainer-client issue); extra arguments are passed through.
set -eu
exec torchrun --nproc_per_node="${HARTS_NPROC:-2}" -m trainer.train \
    --planner-url "${HARTS_PLANNER_URL:-http://planner:8000}" --steps "${HARTS_STEPS:-3}" "$@"
