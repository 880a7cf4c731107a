"""One process, one core, two transports: uvicorn (HTTP) and grpc.aio on one event loop.

Run it with `harts serve --host 127.0.0.1 --http-port 8000 --grpc-port 50051 --db harts.db`.
Start-up compiles the Numba code and resumes interrupted plans before either port opens, then
prints one line on stderr that tests and scripts wait for:

    harts serve: ready http=http://HOST:PORT grpc=HOST:PORT

Ports may be 0 (the line then names the ports the OS chose). SIGINT/SIGTERM stop both servers.

`ServerProcess` starts the service as a subprocess on loopback (tests, benchmarks).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import uvicorn

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.grpc_api import add_to_server, set_serving
from planner_service.http_api import create_app

log = logging.getLogger(__name__)

__all__ = ["serve", "run", "ServerProcess", "READY_RE"]

READY_RE = re.compile(r"harts serve: ready http=(\S+) grpc=(\S+)")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(cfg: ServiceConfig, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 50051) -> None:
    """Run the service until SIGINT/SIGTERM."""
    core = PlannerCore(cfg)
    await asyncio.to_thread(core.start)
    grpc_server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
    ])
    health = add_to_server(grpc_server, core)
    bound_grpc = grpc_server.add_insecure_port(_hostport(host, grpc_port))
    if bound_grpc == 0:
        raise OSError(f"grpc_port: cannot bind {_hostport(host, grpc_port)}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, http_port))
    bound_http = sock.getsockname()[1]
    app = create_app(core)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    ))
    await grpc_server.start()
    await set_serving(health, True)
    print(f"harts serve: ready http=http://{_hostport(host, bound_http)} grpc={_hostport(host, bound_grpc)}",
          file=sys.stderr, flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        core.stop_serving()
        await set_serving(health, False)
        await grpc_server.stop(grace=2.0)
        await asyncio.to_thread(core.close)
        log.info("stopped")


def run(cfg: ServiceConfig, *, host: str, http_port: int, grpc_port: int) -> int:
    asyncio.run(serve(cfg, host=host, http_port=http_port, grpc_port=grpc_port))
    return 0


class ServerProcess:
    """`harts serve` as a subprocess on loopback with OS-chosen ports (for tests and benchmarks).

    Args:
        db: database path (reuse it to restart on the same data).
        token: bearer token, or None.
        extra: further `harts serve` arguments.
        log_path: where stdout/stderr go (a temp file by default).
    """

    def __init__(self, db: str | Path, *, token: str | None = None, extra: list[str] | None = None,
                 log_path: str | Path | None = None, timeout: float = 120.0):
        self.db = str(db)
        self.token = token
        self.extra = list(extra or [])
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="harts-serve-", suffix=".log")[1])
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.http_url = ""
        self.grpc_target = ""

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "harts_cli.main", "serve", "--host", "127.0.0.1", "--http-port", "0",
               "--grpc-port", "0", "--db", self.db, *self.extra]
        env = dict(os.environ)
        if self.token is not None:
            env["HARTS_TOKEN"] = self.token
        else:
            env.pop("HARTS_TOKEN", None)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=Path(__file__).resolve().parent.parent)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            m = READY_RE.search(text)
            if m:
                self.http_url, self.grpc_target = m.group(1), m.group(2)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"harts serve exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"harts serve not ready after {self.timeout} s:\n{self.log_path.read_text()[-4000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        """Send `sig` (SIGKILL by default) and reap the process; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stop(self) -> int | None:
        """Graceful stop (SIGTERM)."""
        return self.kill(signal.SIGTERM)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
