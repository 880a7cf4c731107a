"""Durability: SIGKILL the server, restart it on the same database, get byte-identical plans."""
from __future__ import annotations

import httpx
import pytest

from planner_service.ingest import json_to_proto
from planner_service.server import ServerProcess
from tests.service_helpers import TOPOLOGY, rollout_doc

pytestmark = pytest.mark.integration


def test_sigkill_and_restart_serve_identical_plans(tmp_path):
    db = tmp_path / "durable.db"
    srv = ServerProcess(db).start()
    try:
        c = httpx.Client(base_url=srv.http_url, timeout=20)
        assert c.post("/v1/steps", json=rollout_doc("d-json"), params=TOPOLOGY).status_code == 200
        pb = json_to_proto(rollout_doc("d-pb", seed=5)).SerializeToString(deterministic=True)
        r = c.post("/v1/steps", content=pb, headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200
        assert c.post("/v1/steps/d-pb/plan", json=TOPOLOGY).status_code == 200
        assert c.post("/v1/steps", json=rollout_doc("d-later", seed=6)).status_code == 200  # never planned
        before = {}
        for step in ("d-json", "d-pb"):
            for rank in range(2):
                resp = c.get(f"/v1/steps/{step}/ranks/{rank}/plan", params={"wait": 10})
                assert resp.status_code == 200
                before[step, rank] = (resp.content, resp.headers["x-harts-checksum"])
        status_before = c.get("/v1/steps").json()
        c.close()
    finally:
        assert srv.kill() == -9  # SIGKILL: no shutdown code runs

    srv = ServerProcess(db).start()
    try:
        c = httpx.Client(base_url=srv.http_url, timeout=20)
        for (step, rank), (content, checksum) in before.items():
            resp = c.get(f"/v1/steps/{step}/ranks/{rank}/plan")
            assert resp.status_code == 200
            assert resp.content == content and resp.headers["x-harts-checksum"] == checksum
        assert c.get("/v1/steps").json() == status_before
        # idempotency survives the restart; the unplanned step can still be planned
        r = c.post("/v1/steps", content=pb, headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200 and r.json()["duplicate"] is True
        assert c.post("/v1/steps", json=rollout_doc("d-json", seed=9)).status_code == 409
        assert c.post("/v1/steps/d-later/plan", json=TOPOLOGY).json()["state"] == "planned"
        c.close()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_text()
