"""Schemathesis fuzzes the HTTP API from its own OpenAPI document: no input may cause a 5xx.

The app runs in-process (ASGI) over a started core. Each operation gets a bounded number of
schema-conforming (positive) and schema-violating (negative) requests, with the bearer token, so
the handlers behind auth are reached. (schemathesis' lazy pytest loader does not run under
pytest 9, so the operations are driven with hypothesis directly.)
"""
from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.http_api import create_app
from proto.harts.v1 import planner_pb2
from tests.service_helpers import TOPOLOGY, rollout_doc

TOKEN = "fuzz-token"
STEP = "fuzz-step"
EXAMPLES = 15


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    core = PlannerCore(ServiceConfig(db_path=str(tmp_path_factory.mktemp("fuzz") / "fuzz.db"), token=TOKEN,
                                     max_request_bytes=1 << 20, max_wait_seconds=0.1))
    core.start()
    # a stored, planned step, so fuzzed requests naming it reach past "not found"
    core.submit(json.dumps(rollout_doc(STEP)).encode(), "json")
    core.plan(STEP, planner_pb2.Topology(**TOPOLOGY))
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app(core))
    core.close()


@pytest.mark.parametrize(
    "mode, known_step",
    [(GenerationMode.POSITIVE, False), (GenerationMode.NEGATIVE, False), (GenerationMode.POSITIVE, True)],
    ids=["positive", "negative", "positive-known-step"],
)
def test_no_input_causes_a_server_error(api_schema, mode, known_step):
    operations = [r.ok() for r in api_schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/steps", "POST /v1/steps/{step_id}/plan", "GET /v1/steps/{step_id}/ranks/{rank}/plan",
            "GET /v1/steps/{step_id}", "GET /v1/steps", "GET /metrics"} <= labels
    seen: dict[str, set[int]] = {}
    if known_step:
        operations = [op for op in operations if "{step_id}" in op.path]
    for op in operations:
        fixed = {}
        if known_step:
            fixed = {"path_parameters": {"step_id": STEP, **({"rank": 1} if "{rank}" in op.path else {})}}

        @given(case=op.as_strategy(generation_mode=mode, **fixed))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error])
            seen.setdefault(op.label, set()).add(response.status_code)
            assert b"Traceback" not in response.content

        try:
            fuzz()
        except Unsatisfiable:  # nothing to violate: an operation without parameters or body
            assert mode == GenerationMode.NEGATIVE and op.label in ("GET /healthz", "GET /readyz", "GET /metrics")
    assert {"GET /v1/steps/{step_id}/ranks/{rank}/plan", "GET /v1/steps/{step_id}"} <= set(seen), seen
    if known_step:
        assert 200 in seen["GET /v1/steps/{step_id}"] and 200 in seen["GET /v1/steps/{step_id}/ranks/{rank}/plan"], seen
    assert all(code < 500 for codes in seen.values() for code in codes), seen
