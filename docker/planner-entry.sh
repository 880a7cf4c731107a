#!/bin/sh
# Planner container entry point: `harts serve` on all interfaces, database on the /data volume.
# HARTS_TOKEN (bearer token) and HARTS_WORLD_SIZE / HARTS_MICROBATCH_TOKENS / HARTS_CHUNK_SIZE
# (default topology: plan every submission at once) come from the environment. Plans open sharing
# windows; HARTS_NO_WINDOWS=1 is the ablation that duplicates prefixes instead.
set -eu
[ "${HARTS_NO_WINDOWS:-0}" = "1" ] && set -- --no-windows "$@"
set -- --host 0.0.0.0 \
    --http-port "${HARTS_HTTP_PORT:-8000}" --grpc-port "${HARTS_GRPC_PORT:-50051}" \
    --db "${HARTS_DB:-/data/harts.db}" \
    --world-size "${HARTS_WORLD_SIZE:-0}" --microbatch-tokens "${HARTS_MICROBATCH_TOKENS:-4096}" \
    --chunk-size "${HARTS_CHUNK_SIZE:-64}" "$@"
exec harts serve "$@"
