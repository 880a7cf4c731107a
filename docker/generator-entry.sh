#!/bin/sh
# Demo rollout generator: `harts gen` one batch per step, submitted with the trainer client
# (which waits for a ready planner, retries transient failures and is idempotent by batch_id).
#   HARTS_PLANNER_URL, HARTS_TOKEN, HARTS_STEPS (default 3), HARTS_SCHEME (group|tree|percall),
#   HARTS_TASKS (default 4), HARTS_SCALE (default 0.02: lengths for a CPU/tiny-model demo)
set -eu
steps="${HARTS_STEPS:-3}"
i=0
while [ "$i" -lt "$steps" ]; do
    out="/tmp/step-$i.json"
    harts gen --scheme "${HARTS_SCHEME:-tree}" --tasks "${HARTS_TASKS:-4}" --seed "$i" \
        --scale "${HARTS_SCALE:-0.02}" --old-logprobs --batch-id "step-$i" -o "$out"
    python -m harts_client.client --url "${HARTS_PLANNER_URL:-http://planner:8000}" submit "$out"
    i=$((i + 1))
done
