"""harts_client.client against a real `harts serve`: submit, long-poll fetch, retries, checksum checks."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from planner_service.ingest import json_to_proto
from planner_service.server import ServerProcess
from plan.seal import ChecksumError
from proto.harts.v1 import rollouts_pb2
from tests.service_helpers import TOPOLOGY, rollout_doc
from harts_client import client as client_module
from harts_client.client import PlannerClient, PlannerError, RetryPolicy, WrongSliceError

pytestmark = pytest.mark.integration

TOKEN = "client-token"
FAST = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.05)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("client") / "planner.db", token=TOKEN).start()
    yield srv
    srv.stop()


class FakeClock:
    """Stands in for the client module's `time`: sleeping advances the clock at once and every
    request through a `Flaky` transport that holds it takes `latency` seconds, so deadlines and
    back-off are checked in the client's own seconds, whatever the machine's load."""

    def __init__(self, latency: float = 0.01):
        self.now = 1000.0
        self.slept = 0.0
        self.latency = latency

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


class Flaky(httpx.BaseTransport):
    """Forwards to the real server, but first fails `fail` times in the given way; counts calls."""

    def __init__(self, kind: str, fail: int, only: str = "", clock: FakeClock | None = None):
        self.inner = httpx.HTTPTransport()
        self.kind, self.fail, self.only, self.calls, self.clock = kind, fail, only, 0, clock

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.only not in request.url.path:
            return self.inner.handle_request(request)
        self.calls += 1
        if self.clock is not None:
            self.clock.now += self.clock.latency
        if self.calls <= self.fail:
            if self.kind == "connect":
                raise httpx.ConnectError("refused", request=request)
            if self.kind in ("503", "retry-after"):
                headers = {"Retry-After": "1"} if self.kind == "retry-after" else {}
                return httpx.Response(503, json={"error": {"code": "UNAVAILABLE", "message": "busy"}}, headers=headers,
                                      request=request)
            if self.kind == "other-rank":  # a proxy that mixes up answers
                request.url = request.url.copy_with(path=request.url.path.replace("/ranks/0/", "/ranks/1/"))
            if self.kind == "other-step":
                request.url = request.url.copy_with(path=request.url.path.replace("/c-json/", "/c-pb/"))
        resp = self.inner.handle_request(request)
        if self.kind == "corrupt" and self.calls <= self.fail:
            data = bytearray(resp.read())
            data[len(data) // 2] ^= 0xFF
            return httpx.Response(resp.status_code, headers=resp.headers, content=bytes(data), request=request)
        return resp


def test_submit_then_fetch_verified_slices(server):
    with PlannerClient(server.http_url, token=TOKEN) as c:
        out = c.submit(rollout_doc("c-json"), **TOPOLOGY)
        assert out["duplicate"] is False
        assert c.submit(rollout_doc("c-json"), **TOPOLOGY)["duplicate"] is True
        slices = [c.fetch_plan("c-json", r, timeout=30) for r in range(2)]
        assert [s.rank.rank for s in slices] == [0, 1]
        assert c.fetch_plan_bytes("c-json", 1, timeout=30) == c.fetch_plan_bytes("c-json", 1, timeout=30)
        assert c.status("c-json")["state"] == "planned"
        c.submit(json_to_proto(rollout_doc("c-pb", seed=2)))  # protobuf body, planned on request
        assert c.plan("c-pb", **TOPOLOGY)["state"] == "planned"
        assert {"c-json", "c-pb"} <= {s["step_id"] for s in c.list_steps()}


def test_fetch_long_polls_until_the_step_is_submitted_and_planned(server):
    with PlannerClient(server.http_url, token=TOKEN) as gen, PlannerClient(server.http_url, token=TOKEN) as tr:
        timer = threading.Timer(0.5, lambda: gen.submit(rollout_doc("c-late", seed=4), **TOPOLOGY))
        t0 = time.perf_counter()
        timer.start()
        slice_ = tr.fetch_plan("c-late", 0, timeout=30, poll=2)  # a TimeoutError after 30 s otherwise
        timer.join()
        assert slice_.header.step_id == "c-late" and time.perf_counter() - t0 > 0.4  # it waited for the submission
        with pytest.raises(TimeoutError):
            tr.fetch_plan("c-never", 0, timeout=0.5, poll=0.2)


@pytest.mark.parametrize("kind", ["connect", "503"])
def test_transient_failures_are_retried(server, kind):
    flaky = Flaky(kind, fail=2, only="/v1/steps")
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        assert c.submit(rollout_doc(f"c-retry-{kind}", seed=5), **TOPOLOGY)["status"]["step_id"] == f"c-retry-{kind}"
    assert flaky.calls == 3
    flaky = Flaky(kind, fail=10, only="/v1/steps")
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        with pytest.raises(PlannerError):
            c.status(f"c-retry-{kind}")
    assert flaky.calls == FAST.attempts


def test_client_errors_are_not_retried(server):
    flaky = Flaky("none", fail=0, only="/v1/steps")
    with PlannerClient(server.http_url, token="wrong", retry=FAST, transport=flaky) as c:
        with pytest.raises(PlannerError) as err:
            c.status("anything")
    assert err.value.status == 401 and flaky.calls == 1
    bad = rollout_doc("c-bad")
    bad["trajectories"][0]["tokens"] = []
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST) as c:
        with pytest.raises(PlannerError) as err:
            c.submit(bad)
        assert err.value.status == 422 and err.value.field.startswith("trajectories[0].tokens")
        c.submit(rollout_doc("c-rank"), **TOPOLOGY)
        with pytest.raises(PlannerError) as err:
            c.fetch_plan("c-rank", 7, timeout=10)
        assert err.value.status == 404 and "rank" in err.value.message


def test_corrupted_slices_are_refetched_then_refused(server):
    with PlannerClient(server.http_url, token=TOKEN) as c:
        c.submit(rollout_doc("c-corrupt", seed=8), **TOPOLOGY)
        good = c.fetch_plan_bytes("c-corrupt", 0, timeout=30)
    flaky = Flaky("corrupt", fail=1, only="/ranks/")
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        assert c.fetch_plan_bytes("c-corrupt", 0, timeout=30) == good
    assert flaky.calls == 2
    flaky = Flaky("corrupt", fail=100, only="/ranks/")
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        with pytest.raises(ChecksumError):
            c.fetch_plan_bytes("c-corrupt", 0, timeout=30)
    assert flaky.calls == FAST.attempts


class BitFlip(httpx.BaseTransport):
    """A proxy that flips one bit of the first `bodies` submission bodies (in the first token id,
    so that the batch stays valid with other tokens, as in the audit) and one hex digit of the
    first `answers` submission answers' body_sha256."""

    def __init__(self, *, bodies: int = 0, answers: int = 0):
        self.inner = httpx.HTTPTransport()
        self.bodies, self.answers, self.calls = bodies, answers, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/v1/steps":
            return self.inner.handle_request(request)
        self.calls += 1
        if self.calls <= self.bodies:
            body = bytearray(request.read())
            if request.headers["content-type"] == client_module.PROTOBUF:  # the first trajectory's int32 tokens
                tokens = rollouts_pb2.RolloutBatch.FromString(bytes(body)).trajectories[0].tokens
                at = body.index(tokens)
            else:
                at = body.index(b'"tokens":[') + len(b'"tokens":[')
            body[at] ^= 1
            request = httpx.Request(request.method, request.url, headers=request.headers, content=bytes(body))
        resp = self.inner.handle_request(request)
        if self.calls <= self.answers and resp.status_code == 200:
            answer = json.loads(resp.read())
            answer["body_sha256"] = ("0" if answer["body_sha256"][0] != "0" else "1") + answer["body_sha256"][1:]
            return httpx.Response(200, json=answer, request=request)
        return resp


@pytest.mark.parametrize("form", ["json", "protobuf"])
def test_a_body_altered_on_the_way_is_refused_and_sent_again(server, form):
    """The audit's proxy flipped one bit per submission: 45 of 50 JSON and 42 of 50 protobuf
    submissions were acknowledged with altered tokens. Now the service refuses them (nothing
    stored), the client sends them again, and what is stored is what was sent."""
    doc = rollout_doc(f"c-flip-{form}", seed=11)
    batch = json_to_proto(doc) if form == "protobuf" else doc
    proxy = BitFlip(bodies=2)
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=proxy) as c:
        out = c.submit(batch)
    assert proxy.calls == 3 and out["duplicate"] is False
    with PlannerClient(server.http_url, token=TOKEN) as c:  # the stored content is the sent one
        assert c.submit(doc)["duplicate"] is True
    proxy = BitFlip(bodies=100)
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=proxy) as c:
        with pytest.raises(client_module.IntegrityError, match="altered in transit"):
            c.submit(rollout_doc("c-flip-always", seed=12))
        assert "c-flip-always" not in {s["step_id"] for s in c.list_steps()}
    assert proxy.calls == FAST.attempts


def test_an_answer_naming_other_bytes_is_asked_again_then_raised(server):
    doc = rollout_doc("c-answer", seed=13)
    proxy = BitFlip(answers=1)
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=proxy) as c:
        out = c.submit(doc)
    assert proxy.calls == 2 and out["duplicate"] is True  # stored by the first attempt, confirmed by the second
    proxy = BitFlip(answers=100)
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=proxy) as c:
        with pytest.raises(client_module.IntegrityError, match="body_sha256|Body-Sha256"):
            c.submit(doc)
    assert proxy.calls == FAST.attempts


class OlderServer(httpx.BaseTransport):
    """Answers submissions as a planner of an earlier version: without body_sha256."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = self.inner.handle_request(request)
        if request.method == "POST" and request.url.path == "/v1/steps" and resp.status_code == 200:
            answer = json.loads(resp.read())
            del answer["body_sha256"]
            return httpx.Response(200, json=answer, request=request)
        return resp


def test_a_planner_reporting_no_digest_is_accepted_with_one_warning(server, caplog):
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=OlderServer()) as c:
        with caplog.at_level("WARNING", logger=client_module.__name__):
            for i in range(2):
                assert "body_sha256" not in c.submit(rollout_doc(f"c-older-{i}", seed=14 + i))
    assert sum("reports no body_sha256" in r.getMessage() for r in caplog.records) == 1


def test_client_does_not_import_the_service(server, tmp_path):
    code = "import sys, harts_client.client; print(sorted(m for m in sys.modules if m.startswith('planner_service')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    path = tmp_path / "rollouts.json"
    import json

    path.write_text(json.dumps(rollout_doc("c-cli", seed=9)))
    env_cmd = [sys.executable, "-m", "harts_client.client", "--url", server.http_url, "--token", TOKEN]
    sub = subprocess.run([*env_cmd, "submit", str(path), "--world-size", "2", "--microbatch-tokens", "128",
                          "--chunk-size", "16"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert sub.returncode == 0, sub.stderr
    got = subprocess.run([*env_cmd, "fetch", "c-cli", "1", "--timeout", "30", "-o", str(tmp_path / "r1.pb")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stderr
    assert '"rank": 1' in got.stdout and (tmp_path / "r1.pb").stat().st_size > 0


def test_retries_stop_at_the_callers_deadline(server, monkeypatch):
    slow = RetryPolicy()  # no attempt cap, backoff up to 5 s: only the deadline stops it
    clock = FakeClock()
    monkeypatch.setattr(client_module, "time", clock)
    for kind in ("503", "connect"):
        flaky = Flaky(kind, fail=10_000, only="/v1/steps", clock=clock)
        with PlannerClient(server.http_url, token=TOKEN, retry=slow, transport=flaky, timeout=1.0) as c:
            t0 = clock.now
            with pytest.raises(PlannerError):
                c.status("c-deadline")
            assert clock.now - t0 <= 1.0 + clock.latency and flaky.calls >= 2, kind  # retried, within the call's timeout
            t0, calls = clock.now, flaky.calls
            with pytest.raises((PlannerError, TimeoutError)):
                c.fetch_plan("c-deadline", 0, timeout=1.5)
            assert clock.now - t0 <= 1.5 + clock.latency and flaky.calls > calls, kind


def test_retry_after_of_a_503_is_honoured(server, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(client_module, "time", clock)
    flaky = Flaky("retry-after", fail=1, only="/v1/steps", clock=clock)
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        c.list_steps()
        assert clock.slept >= 1.0 and flaky.calls == 2  # Retry-After: 1 beats FAST's short back-off


def test_a_slice_of_another_step_rank_or_world_size_is_refused(server):
    with PlannerClient(server.http_url, token=TOKEN) as c:
        c.submit(rollout_doc("c-json"), **TOPOLOGY)
        c.submit(rollout_doc("c-pb", seed=2), **TOPOLOGY)
        good = c.fetch_plan_bytes("c-json", 0, timeout=30, world_size=2)
    for kind, what in (("other-rank", "rank 1"), ("other-step", "step 'c-pb'")):
        flaky = Flaky(kind, fail=1, only="/ranks/")  # once: fetched again, then right
        with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
            assert c.fetch_plan_bytes("c-json", 0, timeout=30) == good and flaky.calls == 2
        flaky = Flaky(kind, fail=100, only="/ranks/")  # always: refused
        with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
            with pytest.raises(WrongSliceError, match=what):
                c.fetch_plan_bytes("c-json", 0, timeout=30)
        assert flaky.calls == FAST.attempts
    flaky = Flaky("none", fail=0, only="/ranks/")
    with PlannerClient(server.http_url, token=TOKEN, retry=FAST, transport=flaky) as c:
        with pytest.raises(WrongSliceError, match="world_size 2"):
            c.fetch_plan("c-json", 0, timeout=30, world_size=3)
    assert flaky.calls == 1  # another topology does not get better: refused at once


def test_step_ids_are_url_encoded_and_steps_can_be_deleted(server):
    step = "c odd?id#1%2"
    with PlannerClient(server.http_url, token=TOKEN) as c:
        c.submit(rollout_doc(step), **TOPOLOGY)
        assert c.fetch_plan(step, 1, timeout=30).header.step_id == step
        assert c.status(step)["step_id"] == step
        assert c.delete(step)["step_id"] == step
        with pytest.raises(PlannerError) as err:
            c.status(step)
        assert err.value.status == 404


# ---- outages and replicas


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_url_fails_over_to_the_next_and_says_who_did_not_answer(server):
    dead = f"http://127.0.0.1:{_free_port()}"
    with PlannerClient(f"{dead},{server.http_url}", token=TOKEN, retry=FAST) as c:
        c.submit(rollout_doc("c-failover", seed=11), **TOPOLOGY)
        assert c.url == server.http_url  # it stays with the one that answered
        assert len(c.fetch_plan_bytes("c-failover", 1, timeout=30)) > 0
    with PlannerClient([dead], token=TOKEN, timeout=1.5) as c:
        with pytest.raises(PlannerError) as err:
            c.status("c-failover")
        assert err.value.status == 0 and re.search(rf"no answer from {dead} for \d+ s", err.value.message)
        with pytest.raises(TimeoutError, match=f"no answer from {dead} for"):
            c.fetch_plan("c-failover", 0, timeout=1.5)
    for bad in ("", "ftp://x", " , "):
        with pytest.raises(ValueError, match="url"):
            PlannerClient(bad)
    with PlannerClient(server.http_url, token=TOKEN) as c:
        for bad in (".", ".."):  # URL segments that name no step (the service refuses such batch ids)
            with pytest.raises(ValueError, match="step_id"):
                c.status(bad)


@pytest.mark.slow
def test_a_long_poll_rides_out_a_planner_down_for_15_s(tmp_path):
    """A defect: `fetch_plan_bytes(sid, 0, timeout=120)` gave up after 12-14 s of a 15 s outage."""
    srv = ServerProcess(tmp_path / "down.db", token=TOKEN, http_port=_free_port(), grpc_port=_free_port()).start()
    got: dict = {}
    with PlannerClient(srv.http_url, token=TOKEN) as c:
        srv.kill()
        poll = threading.Thread(target=lambda: got.update(data=c.fetch_plan_bytes("c-down", 0, timeout=120)))
        t0 = time.monotonic()
        poll.start()
        time.sleep(15.0)
        assert poll.is_alive()
        srv.start()
        try:
            c.submit(rollout_doc("c-down", seed=12), **TOPOLOGY)
            poll.join(60)
            assert len(got["data"]) > 0 and time.monotonic() - t0 >= 15
        finally:
            srv.stop()
