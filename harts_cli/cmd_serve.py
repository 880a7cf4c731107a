"""Run the planner service: HTTP (FastAPI, /docs) and gRPC (harts.v1.Planner) in one process.

    harts serve --host 127.0.0.1 --http-port 8000 --grpc-port 50051 --db harts.db [--token T]
    harts serve --db postgresql://harts@db:5432/harts ...   # replicas sharing one database
    harts serve --world-size 8 --lockstep ...               # plan every submission for this default topology

The token may also come from HARTS_TOKEN; `--cost-model F` and `--model CFG` apply to every
topology that names none. SIGTERM and SIGINT drain and exit 0. Replicas, durability
(`--accept-data-loss`), retention and limits: README.md ("The planner service in operation").
"""
from __future__ import annotations

import argparse
import json
import os

from harts_cli.model_arg import resolve_model
from harts_cli.topology_flags import add_topology_arguments, topology_from_args
from planner_service.core import ServiceConfig
from planner_service.planner.cost_model import CostModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--db", default="harts.db",
                   help="SQLite database file (WAL mode), or a postgresql://user[:password]@host[:port]/dbname URL "
                        "that several replicas share (each step is planned once; long-polls wake on every replica)")
    p.add_argument("--token", default=os.environ.get("HARTS_TOKEN") or None,
                   help="bearer token required on every non-health endpoint (default: $HARTS_TOKEN)")
    p.add_argument("--max-request-mb", type=float, default=1024.0, help="largest request body in MiB (413 above; default 1024, ingest's body limit)")
    g = p.add_argument_group("default topology (plan every submission at once; harts.v1.Topology)")
    add_topology_arguments(g, defaults={"world_size": 0}, help={
        "world_size": "data-parallel ranks (0: no default topology)",
        "microbatch_tokens": "token budget per microbatch; also what a request's 0 (or none) means (default 4096)",
        "chunk_size": "linear-attention chunk size C; also what a request's 0 means (default 64)",
    })
    g.add_argument("--conv-kernel", type=int, default=4, help="short-convolution kernel size of the model")
    p.add_argument("--cost-model", default=None, help="cost model JSON from `harts calibrate` for topologies that name none")
    p.add_argument("--model", default=None,
                   help="trainer model (config.json path or named config) for topologies that name none")
    p.add_argument("--plan-workers", type=int, default=1, help="planning threads")
    p.add_argument("--max-wait", type=float, default=60.0, help="longest long-poll wait in seconds")
    p.add_argument("--synchronous", default="FULL", choices=["NORMAL", "FULL"],
                   help="SQLite synchronous mode (FULL: durable across power loss)")
    p.add_argument("--min-free-mb", type=float, default=64.0,
                   help="SQLite: disk space (MiB) that writes leave free; below it writes get 503 and the service is "
                        "not ready, so a full disk recovers as soon as space is freed (default 64; 0: none)")
    p.add_argument("--accept-data-loss", action="store_true",
                   help="SQLite: serve a database that lacks writes the service acknowledged (deleted, replaced or "
                        "restored from an older copy while the service was down or killed) as it is; without it the "
                        "service is not ready on such a database and /readyz says why")
    p.add_argument("--cache-mb", type=float, default=256.0,
                   help="MiB of sealed plan slices kept in memory, and again of submitted forests (default 256)")
    r = p.add_argument_group("retention (deleted steps lose their rollouts and plans; the file is compacted)")
    r.add_argument("--retain-steps", type=int, default=0, help="keep only the newest N steps (0: keep all)")
    r.add_argument("--max-age", type=float, default=0.0,
                   help="delete steps submitted more than this many seconds ago (0: no age limit)")
    r.add_argument("--vacuum", action="store_true",
                   help="VACUUM the database once before the service is ready (converts a database of an earlier "
                        "version so that deletions shrink the file; needs free disk space of twice its size)")
    c = p.add_argument_group("connections (each transport)")
    c.add_argument("--max-connections", type=int, default=1000,
                   help="open connections at most; a new one closes the longest-waiting half-sent or idle "
                        "HTTP connection (never one that has just opened), or gets 503 when all are busy "
                        "(default 1000)")
    c.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds to send a request's headers (gRPC: the connection handshake); 408 after (default 10)")
    c.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds allowed between two pieces of a request body; 408 after (default 30)")
    c.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds an idle keep-alive connection stays open (default 30)")


def run(args: argparse.Namespace) -> int:
    # the server stack (uvicorn, grpc, FastAPI) is imported here, on use: optional for every
    # other `harts` command, whose parser imports this module
    from planner_service.server import run as run_server
    from planner_service.transport.http_guard import ConnectionConfig

    cost_model = CostModel.load(args.cost_model).to_json() if args.cost_model else ""
    model = json.dumps(resolve_model(args.model)[1], sort_keys=True) if args.model else ""
    cache = int(args.cache_mb * 1024 * 1024)
    cfg = ServiceConfig(
        db_path=args.db,
        token=args.token,
        max_request_bytes=int(args.max_request_mb * 1024 * 1024),
        default_topology=topology_from_args(args) if args.world_size else None,
        conv_kernel=args.conv_kernel,
        default_chunk_size=args.chunk_size,
        default_microbatch_tokens=args.microbatch_tokens,
        plan_workers=args.plan_workers,
        max_wait_seconds=args.max_wait,
        synchronous=args.synchronous,
        min_free_bytes=int(args.min_free_mb * 1024 * 1024),
        slice_cache_bytes=cache,
        forest_cache_bytes=cache,
        retain_steps=args.retain_steps,
        max_age_seconds=args.max_age,
        vacuum=args.vacuum,
        accept_data_loss=args.accept_data_loss,
        cost_model=cost_model,
        model=model,
    )
    connections = ConnectionConfig(max_connections=args.max_connections, header_timeout=args.header_timeout,
                                   body_timeout=args.body_timeout, idle_timeout=args.idle_timeout)
    return run_server(cfg, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, limits=connections)
