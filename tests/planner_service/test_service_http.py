"""The HTTP API of a real `harts serve` subprocess on 127.0.0.1 (one server, with a token)."""
from __future__ import annotations

import time

import httpx
import pytest

from planner_service.ingest import json_to_proto
from planner_service.server import ServerProcess
from plan.seal import open_sealed
from tests.service_helpers import TOPOLOGY, rollout_doc

pytestmark = pytest.mark.integration

TOKEN = "test-token-h4"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("http") / "planner.db"
    srv = ServerProcess(db, token=TOKEN, extra=["--max-request-mb", "1", "--max-wait", "5"]).start()
    yield srv
    srv.stop()
    log = srv.log_text()
    assert "Traceback" not in log
    # Numba code is compiled at start-up, before the ports open, not on the first request
    assert log.index("numba code compiled") < log.index("harts serve: ready")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=20) as c:
        yield c


def test_every_endpoint_but_health_needs_the_token(server):
    url = server.http_url
    for path in ("/v1/steps", "/v1/steps/x", "/v1/steps/x/ranks/0/plan", "/metrics"):
        r = httpx.get(url + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "UNAUTHENTICATED"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/v1/steps", json=rollout_doc("s-noauth")).status_code == 401
    assert httpx.post(url + "/v1/steps/x/plan", json={"world_size": 1}).status_code == 401
    assert httpx.get(url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(url + "/readyz").status_code == 200


def test_submit_json_plan_at_once_and_fetch_identical_bytes(http):
    r = http.post("/v1/steps", json=rollout_doc("s-json"), params=TOPOLOGY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["duplicate"] is False and body["status"]["step_id"] == "s-json"
    assert body["status"]["topology"]["world_size"] == 2
    for rank in range(2):
        first = http.get(f"/v1/steps/s-json/ranks/{rank}/plan", params={"wait": 10})
        assert first.status_code == 200, first.text
        assert first.headers["content-type"] == "application/x-protobuf"
        sl = open_sealed(first.content)
        assert sl.rank.rank == rank and first.headers["x-harts-checksum"] == sl.checksum
        again = http.get(f"/v1/steps/s-json/ranks/{rank}/plan")
        assert again.content == first.content and again.headers["x-harts-checksum"] == sl.checksum
    st = http.get("/v1/steps/s-json").json()
    assert st["state"] == "planned" and st["stats"]["expanded_tokens"] == st["expanded_tokens"]
    assert st["stats"]["compression_ideal"] > 1.0
    assert "s-json" in [s["step_id"] for s in http.get("/v1/steps").json()["steps"]]
    r = http.get("/v1/steps/s-json/ranks/2/plan")
    assert r.status_code == 404 and "rank" in r.json()["error"]["message"]


def test_status_carries_every_plan_statistic(http):
    from proto.harts.v1 import plan_pb2

    r = http.post("/v1/steps", json=rollout_doc("s-lock"), params={**TOPOLOGY, "lockstep": "true"})
    assert r.status_code == 200, r.text
    assert http.get("/v1/steps/s-lock/ranks/0/plan", params={"wait": 10}).status_code == 200
    st = http.get("/v1/steps/s-lock").json()["stats"]
    assert set(st) == {f.name for f in plan_pb2.PlanStats.DESCRIPTOR.fields}
    assert st["lockstep_phases"] > 0 and st["lockstep_ratio"] >= 1.0
    assert st["lockstep_phases"] == st["lockstep_forward_phases"] + st["lockstep_backward_phases"] + st["lockstep_recompute_phases"]


def test_submit_protobuf_is_idempotent_and_conflicts_on_another_body(http):
    doc = rollout_doc("s-pb", seed=3)
    body = json_to_proto(doc).SerializeToString(deterministic=True)
    ct = {"Content-Type": "application/x-protobuf"}
    first = http.post("/v1/steps", content=body, headers=ct)
    assert first.status_code == 200 and first.json()["duplicate"] is False
    again = http.post("/v1/steps", content=body, headers=ct)
    assert again.status_code == 200 and again.json() == {**first.json(), "duplicate": True}
    other = json_to_proto(rollout_doc("s-pb", seed=4)).SerializeToString()
    r = http.post("/v1/steps", content=other, headers=ct)
    assert r.status_code == 409 and r.json()["error"]["code"] == "ALREADY_EXISTS"
    r = http.post("/v1/steps/s-pb/plan", json=TOPOLOGY)
    assert r.status_code == 200 and r.json()["state"] == "planned"
    assert open_sealed(http.get("/v1/steps/s-pb/ranks/1/plan").content).header.step_id == "s-pb"


def test_validation_errors_name_the_field_and_leak_no_trace(http):
    doc = rollout_doc("s-invalid")
    doc["trajectories"][1]["loss_mask"] = doc["trajectories"][1]["loss_mask"][:-1]
    r = http.post("/v1/steps", json=doc)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["field"] == "trajectories[1].loss_mask"
    for content, ctype in ((b"{not json", "application/json"), (b"\xff\x01garbage", "application/x-protobuf"),
                           (b"[1, 2]", "application/json")):
        r = http.post("/v1/steps", content=content, headers={"Content-Type": ctype})
        assert r.status_code in (400, 422), (content, r.text)
        assert "Traceback" not in r.text and 'File "' not in r.text
    r = http.post("/v1/steps", content=b"x", headers={"Content-Type": "text/csv"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "Content-Type"
    r = http.post("/v1/steps/s-invalid/plan", json={"world_size": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.world_size"
    r = http.get("/v1/steps/x/ranks/0/plan", params={"wait": "soon"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "query.wait"
    assert "s-invalid" not in [s["step_id"] for s in http.get("/v1/steps").json()["steps"]]


@pytest.mark.parametrize("params,field,fragment", [
    ({"worldsize": 8}, "query.worldsize", "unknown parameter 'worldsize'"),
    ({"world_size": 2, "chunk": 16}, "query.chunk", "unknown parameter 'chunk'"),
    ({"microbatch_tokens": 64}, "query.microbatch_tokens", "expected world_size with it"),
    ({"lockstep": "true", "chunk_size": 16}, "query.chunk_size", "expected world_size with it"),
], ids=["misspelt-world-size", "unknown-beside-a-topology", "budget-without-world-size", "flags-without-world-size"])
def test_unknown_or_incomplete_submit_queries_are_422_naming_them(http, params, field, fragment):
    """The hostile audit: `?worldsize=8`, or `?microbatch_tokens=64` without `world_size`, answered
    200 and the step was never planned (trainers waited until they timed out)."""
    r = http.post("/v1/steps", json=rollout_doc("s-query"), params=params)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and fragment in err["message"], err
    assert "s-query" not in [s["step_id"] for s in http.get("/v1/steps").json()["steps"]]  # nothing stored


def test_request_size_limit_413_declared_and_streamed(http):
    big = b"{" + b" " * (1 << 20) + b"}"  # the server was started with --max-request-mb 1
    r = http.post("/v1/steps", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "RESOURCE_EXHAUSTED"

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b" " * (64 << 10)

    r = http.post("/v1/steps", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_long_poll_waits_then_404(http):
    t0 = time.perf_counter()
    r = http.get("/v1/steps/never/ranks/0/plan", params={"wait": 0.4})
    assert r.status_code == 404 and time.perf_counter() - t0 >= 0.35
    http.post("/v1/steps", json=rollout_doc("s-unplanned"))
    r = http.get("/v1/steps/s-unplanned/ranks/0/plan", params={"wait": 0.2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "DEADLINE_EXCEEDED"


def test_metrics_in_prometheus_format(http):
    http.get("/v1/steps")
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("harts_requests_total", "harts_request_seconds_bucket", "harts_plan_seconds_count",
                 "harts_compression_achieved_count", "harts_steps_waiting", "harts_ingest_bytes_total"):
        assert name in text, name
    assert 'harts_requests_total{code="200",operation="list_steps",transport="http"}' in text


def test_openapi_is_complete_and_docs_render(server):
    spec = httpx.get(server.http_url + "/openapi.json").json()
    submit = spec["paths"]["/v1/steps"]["post"]
    assert set(submit["requestBody"]["content"]) == {"application/json", "application/x-protobuf"}
    assert {"200", "401", "409", "413", "422"} <= set(submit["responses"])
    assert "RolloutBatchDoc" in spec["components"]["schemas"] and "ErrorBody" in spec["components"]["schemas"]
    fetch = spec["paths"]["/v1/steps/{step_id}/ranks/{rank}/plan"]["get"]
    assert "application/x-protobuf" in fetch["responses"]["200"]["content"]
    assert any(p["name"] == "wait" for p in fetch["parameters"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    docs = httpx.get(server.http_url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert "delete" in spec["paths"]["/v1/steps/{step_id}"]


def _references(html: str) -> list[str]:
    """Every URL a page loads: src/href attributes and the URLs its inline script names."""
    import re

    found = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    found += re.findall(r"""(?:url|spec-url)\s*[:=]\s*["']([^"']+)["']""", html)
    found += re.findall(r"""https?://[^\s"'<>)]+""", html)
    return found


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(server, page):
    r = httpx.get(server.http_url + page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = _references(r.text)
    assert refs, r.text
    scripts = 0
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), f"{page} loads {ref} from elsewhere"
        got = httpx.get(server.http_url + ref)
        assert got.status_code == 200 and len(got.content) > 100, ref
        scripts += got.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert scripts >= 1  # the UI itself, served by this server
    assert "cdn" not in r.text.lower() and "googleapis" not in r.text


def test_openapi_request_examples_are_accepted(http):
    spec = http.get("/openapi.json").json()
    submit = spec["paths"]["/v1/steps"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    plan = spec["paths"]["/v1/steps/{step_id}/plan"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    assert set(submit) == {"flat", "tree"} and "trees" in submit["tree"]["value"]
    assert "trajectories" in submit["flat"]["value"] and plan
    for name, example in submit.items():
        r = http.post("/v1/steps", json=example["value"])
        assert r.status_code == 200, (name, r.text)
        step = example["value"]["batch_id"]
        for topo in plan.values():
            r = http.post(f"/v1/steps/{step}/plan", json=topo["value"])
            assert r.status_code in (200, 409), (name, topo, r.text)  # 409: planned for the other example
            assert r.status_code == 200 or "another topology" in r.json()["error"]["message"]
        assert http.get(f"/v1/steps/{step}").json()["state"] == "planned"


def test_delete_a_step(http, server):
    r = http.post("/v1/steps", json=rollout_doc("s-del"), params=TOPOLOGY)
    assert r.status_code == 200
    assert http.get("/v1/steps/s-del/ranks/0/plan", params={"wait": 10}).status_code == 200
    assert httpx.delete(server.http_url + "/v1/steps/s-del").status_code == 401
    r = http.delete("/v1/steps/s-del")
    assert r.status_code == 200 and r.json()["step_id"] == "s-del" and r.json()["state"] == "planned"
    assert http.get("/v1/steps/s-del").status_code == 404
    assert http.get("/v1/steps/s-del/ranks/0/plan").status_code == 404  # the cached slice is gone too
    assert http.delete("/v1/steps/s-del").status_code == 404
    assert "s-del" not in [s["step_id"] for s in http.get("/v1/steps").json()["steps"]]
    r = http.post("/v1/steps", json=rollout_doc("s-del"))  # the id is free again: a new step
    assert r.status_code == 200 and r.json()["duplicate"] is False


def test_batch_id_with_a_slash_is_rejected(http):
    r = http.post("/v1/steps", json=rollout_doc("team/step-1"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "batch_id"


# ---- the last hostile-audit defects, each from its reproducer


def _head(method: str, path: str, length: int, auth: bool) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: t", "Content-Type: application/json", f"Content-Length: {length}"]
    if auth:
        lines.append(f"Authorization: Bearer {TOKEN}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_plan_request_is_authenticated_and_size_checked_before_its_body_is_read(server, http):
    from tests.service_helpers import raw_request, status_line

    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    # 300 MiB declared, a few bytes sent: the answer comes at once, nothing waits for the rest
    got, _ = raw_request(addr, _head("POST", "/v1/steps/x/plan", 300 << 20, auth=False) + b'{"world_size"')
    assert status_line(got).startswith("HTTP/1.1 401"), got[:300]
    got, _ = raw_request(addr, _head("POST", "/v1/steps/x/plan", 300 << 20, auth=True) + b'{"world_size"')
    assert status_line(got).startswith("HTTP/1.1 413"), got[:300]
    # unparseable JSON without the token: 401, not 422
    r = httpx.post(server.http_url + "/v1/steps/x/plan", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    r = http.post("/v1/steps/x/plan", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    r = http.post("/v1/steps/x/plan", json={"world_size": "2"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.world_size"


def test_memory_tokens_over_the_plans_byte_budget_is_422_naming_the_field(http):
    r = http.post("/v1/steps", json=rollout_doc("s-mem"), params={"world_size": 2, "memory_tokens": 2**62})
    assert r.status_code == 422 and r.json()["error"]["field"] == "topology.memory_tokens", r.text
    assert http.get("/v1/steps/s-mem").status_code == 404  # nothing stored
    assert http.post("/v1/steps", json=rollout_doc("s-mem")).status_code == 200
    r = http.post("/v1/steps/s-mem/plan", json={"world_size": 2, "memory_tokens": 2**62})
    assert r.status_code == 422 and r.json()["error"]["field"] == "topology.memory_tokens", r.text
    assert http.get("/v1/steps/s-mem").json()["state"] == "submitted"  # not marked failed


def test_long_and_unreachable_step_ids_get_errors_that_name_them(server, http):
    from tests.service_helpers import raw_request, status_line

    r = http.get("/v1/steps/" + "x" * 9000)
    assert r.status_code == 422 and r.json()["error"]["field"] == "step_id" and len(r.text) < 1000
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    got, _ = raw_request((host, int(port)), f"GET /v1/steps/{'x' * (1 << 20)} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    assert status_line(got).startswith("HTTP/1.1 431"), got[:200]
    assert b'"code": "INVALID_ARGUMENT"' in got and b"at most 16384 bytes" in got
    for bad in (".", "..", "\x00", "  "):
        r = http.post("/v1/steps", json=rollout_doc(bad))
        assert r.status_code == 422 and r.json()["error"]["field"] == "batch_id", (bad, r.text)
    assert http.get("/v1/steps/%2E%2E").status_code in (404, 422)  # never a 5xx


def test_ids_that_are_not_utf8_name_their_field(http):
    import json as json_

    body = json_.dumps(rollout_doc("s-utf8")).encode().replace(b'"s-utf8-t1"', b'"s-utf8-\xff1"')
    r = http.post("/v1/steps", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "trajectories[1].id", r.text
    assert "UTF-8" in r.json()["error"]["message"]
    pb = json_to_proto(rollout_doc("s-utf8-pb")).SerializeToString().replace(b"s-utf8-pb-t2", b"s-utf8-pb-\xc3(")
    r = http.post("/v1/steps", content=pb, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "trajectories[2].id", r.text


def test_shutdown_answers_waiting_long_polls_instead_of_cancelling_them(tmp_path):
    import threading

    srv = ServerProcess(tmp_path / "stop.db", token=TOKEN).start()
    answers: list[int] = []

    def poll() -> None:
        r = httpx.get(srv.http_url + "/v1/steps/never/ranks/0/plan", params={"wait": 30},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        answers.append(r.status_code)

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    time.sleep(1.0)
    srv.stop()  # SIGTERM (uvicorn exits by the re-raised signal)
    for t in pollers:
        t.join(30)
    assert answers == [503, 503]
    log = srv.log_text()
    assert "ERROR" not in log and "Cancel" not in log and "Traceback" not in log, log[-2000:]
