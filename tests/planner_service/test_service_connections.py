"""Connection exhaustion against a real `harts serve` on 127.0.0.1 (issue 13, item 1; item 6's
ready line and client disconnects).

Half-sent requests, bodies that never arrive, idle and busy connections: health checks keep
answering on both transports, stalled connections get 408 or are closed, a server whose
connections are all busy answers 503, and the log stays short. Every wait is bounded.
"""
from __future__ import annotations

import re
import socket
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.service_helpers import raw_request, start_serve, status_line

pytestmark = pytest.mark.integration

PARTIAL_HEADERS = b"POST /v1/steps HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
STALLED_BODY = (b"POST /v1/steps HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"batch_id\":")
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _enough_fds(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"the test needs {n} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _grpc_health(target: str) -> str:
    with grpc.insecure_channel(target) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as err:
            return err.code().name


def _open(addr, data: bytes, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(addr, timeout=5)
        s.sendall(data)
        socks.append(s)
    return socks


def test_half_sent_requests_do_not_starve_health_checks(tmp_path):
    # a container with `ulimit -n 512`: 700 half-sent requests are more than the process may open
    _enough_fds(2000)
    srv = start_serve(tmp_path / "c.db", tmp_path / "c.log", nofile=512)
    socks: list[socket.socket] = []
    try:
        socks += _open(srv.http_addr, PARTIAL_HEADERS, 400)
        socks += _open(srv.http_addr, STALLED_BODY, 300)
        time.sleep(0.5)
        for _ in range(5):
            got, seconds = raw_request(srv.http_addr, HEALTHZ, timeout=5)
            assert status_line(got) == "HTTP/1.1 200 OK" and seconds < 2.0, (got[:200], seconds)
        assert _grpc_health(srv.grpc_target) == "SERVING"
    finally:
        for s in socks:
            s.close()
        srv.stop()
    log = srv.log_text()
    assert "Traceback" not in log and "out of system resource" not in log
    assert len(log.splitlines()) < 20, log[-3000:]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A server with 8 connections and 1-second header/body timeouts."""
    from planner_service.server import ServerProcess

    d = tmp_path_factory.mktemp("conn")
    srv = ServerProcess(d / "s.db", log_path=d / "s.log", extra=[
        "--max-connections", "8", "--header-timeout", "1", "--body-timeout", "1", "--idle-timeout", "2",
        "--max-wait", "10"]).start()
    # item 6: the ready line comes once the HTTP port accepts: the first connect succeeds
    host, port = srv.http_url.removeprefix("http://").rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=2).close()
    srv.http_addr = (host, int(port))
    yield srv
    srv.stop()


def test_stalled_headers_and_bodies_get_408_and_idle_connections_close(small):
    t0 = time.perf_counter()
    got, seconds = raw_request(small.http_addr, PARTIAL_HEADERS, timeout=6)
    assert status_line(got) == "HTTP/1.1 408 Request Timeout" and 0.8 < seconds < 4, (got, seconds)
    assert b'"DEADLINE_EXCEEDED"' in got and b"headers" in got

    got, seconds = raw_request(small.http_addr, STALLED_BODY, timeout=6)
    assert status_line(got) == "HTTP/1.1 408 Request Timeout" and 0.8 < seconds < 4, (got, seconds)
    assert b"body" in got

    got, seconds = raw_request(small.http_addr, b"", timeout=6)  # connects, sends nothing
    assert got == b"" and seconds < 4

    # an idle keep-alive connection is closed after --idle-timeout
    got, seconds = raw_request(small.http_addr, HEALTHZ.replace(b"Connection: close\r\n", b""), timeout=8)
    assert status_line(got) == "HTTP/1.1 200 OK" and 1.5 < seconds < 5, seconds
    assert time.perf_counter() - t0 < 20

    metrics = httpx.get(small.http_url + "/metrics", timeout=5).text
    for reason in ("header_timeout", "body_timeout"):
        m = re.search(rf'harts_http_connections_closed_total{{reason="{reason}"}} (\S+)', metrics)
        assert m and float(m.group(1)) >= 1, reason


def test_grpc_connections_without_a_handshake_are_closed(small):
    host, port = small.grpc_target.rsplit(":", 1)
    socks = _open((host, int(port)), b"", 20)
    deadline = time.monotonic() + 8
    closed = set()
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            s.settimeout(0.05)
            try:
                while s.recv(65536):
                    pass
                closed.add(i)
            except TimeoutError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.1)
    for s in socks:
        s.close()
    assert len(closed) == len(socks)
    assert _grpc_health(small.grpc_target) == "SERVING"


def test_all_connections_busy_gets_503_then_recovers(small):
    poll = b"GET /v1/steps/never/ranks/0/plan?wait=5 HTTP/1.1\r\nHost: x\r\n\r\n"
    busy = _open(small.http_addr, poll, 8)
    try:
        time.sleep(0.3)
        got, _ = raw_request(small.http_addr, HEALTHZ, timeout=5)
        assert status_line(got) == "HTTP/1.1 503 Service Unavailable", got[:200]
        assert b"retry-after: 1" in got.lower() and b'"UNAVAILABLE"' in got
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got, _ = raw_request(small.http_addr, HEALTHZ, timeout=5)
        if status_line(got) == "HTTP/1.1 200 OK":
            break
        time.sleep(0.1)
    assert status_line(got) == "HTTP/1.1 200 OK"


def test_client_disconnects_are_not_errors_and_free_their_long_poll(small):
    s = socket.create_connection(small.http_addr, timeout=5)
    s.sendall(b"POST /v1/steps HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    time.sleep(0.2)
    s.close()  # gone in the middle of its body
    s = socket.create_connection(small.http_addr, timeout=5)
    s.sendall(b"GET /v1/steps/never/ranks/0/plan?wait=8 HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)
    waiting = lambda: float(re.search(r"^harts_fetch_waiters (\S+)$", httpx.get(small.http_url + "/metrics").text,
                                      re.M).group(1))
    assert waiting() == 1.0
    s.close()  # gone in the middle of its long-poll
    deadline = time.monotonic() + 3
    while waiting() != 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert waiting() == 0.0
    time.sleep(0.3)
    log = small.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_slowloris_that_reconnects_at_once_does_not_evict_legitimate_requests(tmp_path):
    """Issue 22: half-sent connections re-opened as soon as the guard closes them (here 2x the
    connection bound) evicted new legitimate connections: /healthz answered 16 of 86 probes."""
    import json
    import selectors
    import threading

    from planner_service.server import ServerProcess
    from tests.service_helpers import rollout_doc

    srv = ServerProcess(tmp_path / "sl.db", token="sl-token", log_path=tmp_path / "sl.log",
                        extra=["--max-connections", "64", "--header-timeout", "30"]).start()
    host, port = srv.http_url.removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    stop = threading.Event()
    reopened = [0]

    def attack() -> None:
        sel = selectors.DefaultSelector()

        def connect() -> None:
            try:
                s = socket.create_connection(addr, timeout=5)
                s.sendall(PARTIAL_HEADERS)
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            except OSError:
                pass

        for _ in range(128):
            connect()
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data:  # closed by the guard: re-open at once
                    sel.unregister(s)
                    s.close()
                    reopened[0] += 1
                    connect()
        for key in list(sel.get_map().values()):
            key.fileobj.close()

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        time.sleep(1.0)
        answered = 0
        for _ in range(20):
            got, _ = raw_request(addr, HEALTHZ, timeout=10)
            answered += status_line(got) == "HTTP/1.1 200 OK"
        submitted = 0
        for i in range(10):
            body = json.dumps(rollout_doc(f"sl-{i}", seed=i)).encode()
            head = (f"POST /v1/steps HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sl-token\r\nConnection: close\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            got, _ = raw_request(addr, head + body, timeout=20)
            submitted += status_line(got) == "HTTP/1.1 200 OK"
        assert reopened[0] > 0  # the guard did evict the attacker's connections meanwhile
        assert (answered, submitted) == (20, 10)
    finally:
        stop.set()
        attacker.join(30)
        srv.stop()
    assert "Traceback" not in srv.log_text()
