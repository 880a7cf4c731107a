"""One process, one core, two transports: uvicorn (HTTP) and grpc.aio on one event loop.

Run it with `harts serve --host 127.0.0.1 --http-port 8000 --grpc-port 50051 --db harts.db`.
It prints `harts serve: listening http=... grpc=...` once both ports accept and
`harts serve: ready http=... grpc=...` (`READY_RE`) once the service is ready. SIGTERM and SIGINT
drain and close: not ready, long-polls answered 503, gRPC and HTTP grace periods, the plan in
progress finished, the database checkpointed and closed, exit 0; the connection bounds and the
file-descriptor limit are set here. `ServerProcess` runs it as a subprocess on loopback (tests,
benchmarks). See docs/design/service.md ("Stopping", "Connections and request limits").
"""
from __future__ import annotations

import asyncio
import contextlib
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
from planner_service.transport.grpc_servicer import add_to_server, set_serving
from planner_service.transport.http import create_app
from planner_service.transport.http_guard import ConnectionConfig, ConnectionGuard

log = logging.getLogger(__name__)

__all__ = ["serve", "run", "ServerProcess", "READY_RE", "LISTENING_RE"]

READY_RE = re.compile(r"harts serve: ready http=(\S+) grpc=(\S+)")
LISTENING_RE = re.compile(r"harts serve: listening http=(\S+) grpc=(\S+)")

_RESERVED_FDS = 128
"""File descriptors kept for the database, logs, threads and the event loop."""

_BACKLOG = 128
"""Listen backlog of the HTTP socket: also how many connections asyncio accepts in one burst,
before the guard's evictions have closed theirs (so it is kept free under the fd limit too)."""


_GRPC_GRACE_S = 2.0
"""Seconds gRPC calls in flight may take to finish once the service stops."""

_HTTP_GRACE_S = 5
"""Seconds HTTP requests in flight may take to finish once the service stops (uvicorn's
`timeout_graceful_shutdown`)."""


class _Server(uvicorn.Server):
    """uvicorn's server that stops the core's long-polls first when it shuts down: waiting
    fetches answer 503 (clients retry, on another replica if they know one) instead of being
    cancelled after the graceful timeout ("Cancel N running task(s)").

    It leaves the signals to `serve`: uvicorn's own handlers re-raise a captured SIGTERM once
    `serve()` returns, which killed the process (exit -15) before the gRPC grace period, the plan
    pool's drain and the database's close ran."""

    def __init__(self, config: uvicorn.Config, core: PlannerCore):
        super().__init__(config)
        self._core = core

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        self._core.stop_serving()
        await super().shutdown(sockets)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _fit_to_fd_limit(limits: ConnectionConfig) -> tuple[ConnectionConfig, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; lower max_connections (per transport) so
    that both transports' connections fit under it. Returns (limits, the soft limit)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return limits, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    # both transports' connections, plus one accept burst per transport whose evictions have not
    # closed their sockets yet (under load the guard runs a loop iteration or two behind accept)
    fit = max(1, (soft - _RESERVED_FDS - 2 * _BACKLOG) // 2)
    if limits.max_connections > fit:
        log.warning("max_connections lowered from %d to %d: the file-descriptor limit is %d (raise `ulimit -n`)",
                    limits.max_connections, fit, soft)
        limits = ConnectionConfig(max_connections=fit, header_timeout=limits.header_timeout,
                                  body_timeout=limits.body_timeout, idle_timeout=limits.idle_timeout)
    return limits, soft


class _OncePerMinute(logging.Filter):
    """Let each distinct message through once a minute (uvicorn warns once per bad request)."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.levelno}:{record.msg}"
        now = time.monotonic()
        last = self._last.setdefault(key, [-1e9, 0])
        last[1] += 1
        if now - last[0] < 60.0:
            return False
        if last[1] > 1:
            record.msg = f"{record.msg} ({last[1]} times in the last minute)"
        last[0], last[1] = now, 0
        return True


def _once_a_minute(loop: asyncio.AbstractEventLoop) -> None:
    """Loop exception handler that logs each distinct message at most once a minute, with a count."""
    seen: dict[str, list[float]] = {}

    def handler(loop, context) -> None:
        msg = str(context.get("message", "unhandled exception in the event loop"))
        now = time.monotonic()
        last = seen.setdefault(msg, [-1e9, 0])
        last[1] += 1
        if now - last[0] >= 60.0:
            exc = context.get("exception")
            log.error("%s%s%s", msg, f": {exc!r}" if exc is not None else "",
                      f" ({last[1]} times in the last minute)" if last[1] > 1 else "")
            last[0], last[1] = now, 0

    loop.set_exception_handler(handler)


class _StopSignals:
    """SIGTERM and SIGINT, handled on the event loop while installed: the first one logs and sets
    `requested`; a second one stops uvicorn waiting for open HTTP requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.requested = asyncio.Event()
        self.http: uvicorn.Server | None = None
        self._loop = loop
        self._installed: list[int] = []

    def __enter__(self) -> "_StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._loop.add_signal_handler(sig, self._received, signal.Signals(sig).name)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or not POSIX
                continue
            self._installed.append(sig)
        return self

    def __exit__(self, *exc) -> None:
        for sig in self._installed:
            self._loop.remove_signal_handler(sig)

    def _received(self, name: str) -> None:
        if self.requested.is_set():
            log.warning("%s again: not waiting for open HTTP requests", name)
            if self.http is not None:
                self.http.force_exit = True
            return
        log.info("%s received: stopping (gRPC grace %g s, HTTP grace %d s; the plan in progress finishes, "
                 "the database is checkpointed and closed)", name, _GRPC_GRACE_S, _HTTP_GRACE_S)
        self.requested.set()


async def serve(cfg: ServiceConfig, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 50051,
                limits: ConnectionConfig | None = None) -> None:
    """Run the service until SIGTERM or SIGINT, then drain and close (docs/design/service.md, "Stopping")."""
    loop = asyncio.get_running_loop()
    _once_a_minute(loop)
    logging.getLogger("uvicorn.error").addFilter(_OncePerMinute())
    limits, _ = _fit_to_fd_limit(limits or ConnectionConfig())
    with _StopSignals(loop) as signals:
        core = PlannerCore(cfg)
        try:
            await asyncio.to_thread(core.start)
            if not signals.requested.is_set():
                await _serve_started(core, cfg, host, http_port, grpc_port, limits, signals)
        finally:
            await asyncio.to_thread(core.close)
            log.info("stopped")


async def _serve_started(core: PlannerCore, cfg: ServiceConfig, host: str, http_port: int, grpc_port: int,
                         limits: ConnectionConfig, signals: _StopSignals) -> None:
    """Open both ports over a started core and serve until a stop signal; then drain both."""
    loop = asyncio.get_running_loop()
    grpc_server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", int(limits.header_timeout * 1000)),
            ("grpc.max_connection_idle_ms", int(limits.idle_timeout * 1000)),
            ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ],
        maximum_concurrent_rpcs=limits.max_connections,
    )
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
    guard = ConnectionGuard(limits, core.metrics)
    server = _Server(uvicorn.Config(
        create_app(core), http=guard.protocol(), log_level="warning", access_log=False, lifespan="off",
        timeout_keep_alive=limits.idle_timeout, timeout_graceful_shutdown=_HTTP_GRACE_S, backlog=_BACKLOG,
    ), core)
    signals.http = server
    urls = f"http=http://{_hostport(host, bound_http)} grpc={_hostport(host, bound_grpc)}"
    announced = asyncio.Event()

    def readiness(ready: bool, reason: str) -> None:  # from any thread
        def apply() -> None:
            asyncio.ensure_future(set_serving(health, ready))
            if ready and not announced.is_set() and server.started:
                announced.set()
                print(f"harts serve: ready {urls}", file=sys.stderr, flush=True)
        loop.call_soon_threadsafe(apply)

    await grpc_server.start()
    http_task = asyncio.create_task(server.serve(sockets=[sock]))
    stop_task = asyncio.create_task(signals.requested.wait())
    try:
        while not server.started:  # the ready line only once the HTTP port accepts
            if http_task.done():
                await http_task
                raise OSError(f"http_port: the HTTP server did not start on {_hostport(host, bound_http)}")
            await asyncio.sleep(0.01)
        print(f"harts serve: listening {urls}", file=sys.stderr, flush=True)
        ready, reason = core.readiness()
        if not ready:
            print(f"harts serve: not ready: {reason}", file=sys.stderr, flush=True)
        core.on_readiness(readiness)
        await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
        core.stop_serving()
        await set_serving(health, False)
        server.should_exit = True
        # both transports drain at once: gRPC calls within the grace period, HTTP requests
        # within uvicorn's graceful timeout
        await asyncio.gather(grpc_server.stop(grace=_GRPC_GRACE_S), http_task)


def run(cfg: ServiceConfig, *, host: str, http_port: int, grpc_port: int,
        limits: ConnectionConfig | None = None) -> int:
    asyncio.run(serve(cfg, host=host, http_port=http_port, grpc_port=grpc_port, limits=limits))
    return 0


class ServerProcess:
    """`harts serve` as a subprocess on loopback with OS-chosen ports (for tests and benchmarks).

    Args:
        db: database path (reuse it to restart on the same data).
        token: bearer token, or None.
        extra: further `harts serve` arguments.
        log_path: where stdout/stderr go (a temp file by default).
        timeout: seconds `start` waits (a first start compiles the Numba code: over 90 s on a loaded
            2-core machine).
        http_port, grpc_port: ports to listen on (0: chosen by the OS at each start; a fixed port
            lets a restarted server keep its URL).
    """

    def __init__(self, db: str | Path, *, token: str | None = None, extra: list[str] | None = None,
                 log_path: str | Path | None = None, timeout: float = 600.0, http_port: int = 0, grpc_port: int = 0):
        self.http_port, self.grpc_port = http_port, grpc_port
        self.db = str(db)
        self.token = token
        self.extra = list(extra or [])
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="harts-serve-", suffix=".log")[1])
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.http_url = ""
        self.grpc_target = ""

    def start(self, *, ready: bool = True) -> "ServerProcess":
        """Start and wait for the ready line (ready=False: only for the ports to accept)."""
        cmd = [sys.executable, "-m", "harts_cli.main", "serve", "--host", "127.0.0.1", "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--db", self.db, *self.extra]
        env = dict(os.environ)
        if self.token is not None:
            env["HARTS_TOKEN"] = self.token
        else:
            env.pop("HARTS_TOKEN", None)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:  # a restart appends to the same log
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=Path(__file__).resolve().parent.parent)
        pattern = READY_RE if ready else LISTENING_RE
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            m = pattern.search(text)
            if m:
                self.http_url, self.grpc_target = m.group(1), m.group(2)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"harts serve exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"harts serve not {'ready' if ready else 'listening'} after {self.timeout} s:\n"
                           f"{self.log_path.read_text()[-4000:]}")

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
