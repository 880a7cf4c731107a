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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.transport.http import create_app
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, known_step",
    [(GenerationMode.POSITIVE, False), (GenerationMode.NEGATIVE, False), (GenerationMode.POSITIVE, True)],
    ids=["positive", "negative", "positive-known-step"],
)
def test_no_input_causes_a_server_error(api_schema, mode, known_step):
    operations = [r.ok() for r in api_schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/steps", "POST /v1/steps/{step_id}/plan", "GET /v1/steps/{step_id}/ranks/{rank}/plan",
            "GET /v1/steps/{step_id}", "DELETE /v1/steps/{step_id}", "GET /v1/steps", "GET /metrics"} <= labels
    seen: dict[str, set[int]] = {}
    if known_step:  # not DELETE: the other operations need the step
        operations = [op for op in operations if "{step_id}" in op.path and op.method.upper() != "DELETE"]
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


# ---- hostile values: deep nesting, huge numbers, surrogates, wrong types
#
# The schema-driven cases above never send a document nested 100,000 deep or a number with 400
# digits. These do, through the same in-process app; every one must be a 4xx with a JSON error
# body, with nothing stored.


def _doc(batch_id: str, **fields) -> dict:
    traj = {"id": "a", "tokens": [1, 2, 3]}
    traj.update({k: v for k, v in fields.items() if k not in ("vocab_size",)})
    return {"batch_id": batch_id, "vocab_size": fields.get("vocab_size", 64), "trajectories": [traj]}


def _with(batch_id: str, field: str, raw_value: bytes) -> bytes:
    """A valid document whose trajectory gets `field` set to the raw JSON text `raw_value`."""
    base = json.dumps(_doc(batch_id)).encode()
    if field == "tokens":
        return base.replace(b"[1, 2, 3]", raw_value, 1)
    if field == "vocab_size":
        return base.replace(b'"vocab_size": 64', b'"vocab_size": ' + raw_value, 1)
    return base.replace(b'"tokens"', b'"' + field.encode() + b'": ' + raw_value + b', "tokens"', 1)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _with_list(batch_id: str, field: str, raw_value: bytes, *, keep_tokens: bool = False) -> bytes:
    """A document whose trajectory's per-position list `field` is the raw JSON text `raw_value`
    (its other lists stay flat number lists, which the JSON scan parses; `keep_tokens`: a second
    trajectory too, so that parsed lists and the odd string meet in one document)."""
    traj = {"id": "a", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "old_logprobs": [-0.5, -0.5, -0.5],
            "advantage": [0.5, 0.5, 0.5]}
    doc = {"batch_id": batch_id, "vocab_size": 64, "trajectories": [traj] + ([{"id": "b", "tokens": [4, 5]}] if keep_tokens else [])}
    text = json.dumps(doc).encode()
    start = text.index(b'"' + field.encode() + b'": [') + len(field) + 4
    return text[:start] + raw_value + text[text.index(b"]", start) + 1:]


def _model(**changes) -> str:
    from plan.named_models import qwen3_next_80b_a3b

    cfg = qwen3_next_80b_a3b()
    cfg.update(changes)
    return json.dumps(cfg)


def _plan(**topology) -> bytes:
    return json.dumps({**TOPOLOGY, **topology}).encode()


_HUGE = b"1" + b"0" * 400
BAD_INPUTS = [
    # (id, method, path, body, content type)
    ("body-nested-100k", "POST", "/v1/steps", _nested(100_000), "json"),
    ("tokens-nested-100k", "POST", "/v1/steps", json.dumps(_doc("n1")).encode().replace(b"[1, 2, 3]", _nested(100_000)),
     "json"),
    ("tokens-nested-3", "POST", "/v1/steps", json.dumps(_doc("n2")).encode().replace(b"[1, 2, 3]", _nested(3)), "json"),
    ("reward-400-digits", "POST", "/v1/steps", _with("h1", "reward", _HUGE), "json"),
    ("advantage-400-digits", "POST", "/v1/steps", _with("h2", "advantage", _HUGE), "json"),
    ("weight-400-digits", "POST", "/v1/steps", _with("h3", "weight", _HUGE), "json"),
    ("advantage-1e400", "POST", "/v1/steps", _with("h4", "advantage", b"1e400"), "json"),
    ("advantages-list-400-digits", "POST", "/v1/steps", _with("h5", "advantage", b"[1, " + _HUGE + b", 1]"), "json"),
    ("old_logprobs-400-digits", "POST", "/v1/steps", _with("h6", "old_logprobs", b"[0, -" + _HUGE + b", 0]"), "json"),
    ("token-id-10^30", "POST", "/v1/steps", json.dumps(_doc("h7", tokens=[10**30])).encode(), "json"),
    ("vocab_size-400-digits", "POST", "/v1/steps",
     json.dumps(_doc("h8")).encode().replace(b'"vocab_size": 64', b'"vocab_size": ' + _HUGE), "json"),
    ("advantage-NaN", "POST", "/v1/steps", _with("f1", "advantage", b"NaN"), "json"),
    ("reward--Infinity", "POST", "/v1/steps", _with("f2", "reward", b"-Infinity"), "json"),
    ("surrogate-batch_id", "POST", "/v1/steps", json.dumps(_doc("\ud800")).encode(), "json"),
    ("surrogate-trajectory-id", "POST", "/v1/steps", json.dumps(_doc("u2", id="\udfff")).encode(), "json"),
    ("surrogate-tree_id", "POST", "/v1/steps", json.dumps(_doc("u3", tree_id="x\ud800")).encode(), "json"),
    ("bool-tokens", "POST", "/v1/steps", json.dumps(_doc("b1", tokens=[True, 1, 2])).encode(), "json"),
    ("bool-loss_mask", "POST", "/v1/steps", json.dumps(_doc("b2", loss_mask=[True, 0, 1])).encode(), "json"),
    ("string-vocab_size", "POST", "/v1/steps", json.dumps(_doc("b3", vocab_size="64")).encode(), "json"),
    ("batch_id-with-slash", "POST", "/v1/steps", json.dumps(_doc("a/b")).encode(), "json"),
    ("invalid-utf8", "POST", "/v1/steps", b'{"batch_id": "\xff\xfe", "vocab_size": 4}', "json"),
    ("protobuf-nested-groups", "POST", "/v1/steps", b"\x0b" * 100_000, "proto"),
    ("plan-world_size-string", "POST", f"/v1/steps/{STEP}/plan", b'{"world_size": "2"}', "json"),
    ("plan-world_size-true", "POST", f"/v1/steps/{STEP}/plan", b'{"world_size": true}', "json"),
    ("plan-world_size-2.0", "POST", f"/v1/steps/{STEP}/plan", b'{"world_size": 2.0}', "json"),
    ("plan-world_size-400-digits", "POST", f"/v1/steps/{STEP}/plan", b'{"world_size": ' + _HUGE + b"}", "json"),
    ("plan-body-nested-100k", "POST", f"/v1/steps/{STEP}/plan", b'{"world_size": ' + _nested(100_000) + b"}", "json"),
    ("submit-world_size-400-digits", "POST", "/v1/steps?world_size=" + "9" * 400, json.dumps(_doc("q1")).encode(),
     "json"),
    # the hostile audit's inputs that answered 500 with a traceback. Strings shaped
    # like the JSON scan's placeholder of a parsed list, in list fields
    *[(f"placeholder-string-{field}", "POST", "/v1/steps", _with_list(f"ph-{field}", field, b'"\\u00000"'), "json")
      for field in ("tokens", "loss_mask", "old_logprobs", "advantage")],
    ("placeholder-string-10", "POST", "/v1/steps", _with_list("ph-10", "tokens", b'"\\u000010"'), "json"),
    ("placeholder-string-beside-parsed-lists", "POST", "/v1/steps",
     _with_list("ph-mixed", "old_logprobs", b'"\\u00001"', keep_tokens=True), "json"),
    # topology model and cost-model values the parser did not guard
    ("plan-model-full_attention_interval-0", "POST", f"/v1/steps/{STEP}/plan", _plan(model=_model(full_attention_interval=0)), "json"),
    ("plan-model-mlp_only_layers-5", "POST", f"/v1/steps/{STEP}/plan", _plan(model=_model(mlp_only_layers=5)), "json"),
    ("plan-model-mlp_only_layers-nested", "POST", f"/v1/steps/{STEP}/plan", _plan(model=_model(mlp_only_layers=[[1]])), "json"),
    ("plan-model-partial_rotary_factor-1e308", "POST", f"/v1/steps/{STEP}/plan",
     _plan(model=_model(partial_rotary_factor=1e308)), "json"),
    ("plan-model-vocab_size-10^400", "POST", f"/v1/steps/{STEP}/plan",
     _plan(model=_model().replace('"vocab_size": 151936', '"vocab_size": ' + _HUGE.decode())), "json"),
    ("plan-model-layers-3x10^5", "POST", f"/v1/steps/{STEP}/plan", _plan(model=_model(num_hidden_layers=300_000)), "json"),
    ("plan-cost-coefficient-10^400", "POST", f"/v1/steps/{STEP}/plan",
     _plan(cost_model='{"format": "harts.cost_model.v1", "coefficients": {"row": ' + _HUGE.decode() + "}}"), "json"),
    ("plan-model-nested-200k", "POST", f"/v1/steps/{STEP}/plan", _plan(model=_nested(200_000).decode()), "json"),
    ("plan-cost-nested-200k", "POST", f"/v1/steps/{STEP}/plan", _plan(cost_model=_nested(200_000).decode()), "json"),
    ("plan-model-a-list", "POST", f"/v1/steps/{STEP}/plan", _plan(model="[1, 2]"), "json"),
    ("plan-model-rope-not-a-number", "POST", f"/v1/steps/{STEP}/plan",
     _plan(model=_model(rope_parameters={"partial_rotary_factor": "half"})), "json"),
    ("fetch-wait-nan", "GET", f"/v1/steps/{STEP}/ranks/0/plan?wait=nan", None, "json"),
    ("fetch-wait-inf", "GET", f"/v1/steps/{STEP}/ranks/0/plan?wait=inf", None, "json"),
    ("fetch-rank-30-digits", "GET", f"/v1/steps/{STEP}/ranks/{'1' * 30}/plan", None, "json"),
]


@pytest.fixture(scope="module")
def asgi_client(tmp_path_factory):
    import httpx

    core = PlannerCore(ServiceConfig(db_path=str(tmp_path_factory.mktemp("bad") / "bad.db"),
                                     max_request_bytes=4 << 20, max_wait_seconds=0.1))
    core.start()
    core.submit(json.dumps(rollout_doc(STEP)).encode(), "json")
    core.plan(STEP, planner_pb2.Topology(**TOPOLOGY))
    transport = httpx.ASGITransport(app=create_app(core), raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://fuzz")
    yield client, core
    core.close()


def _call(client, method: str, path: str, body: bytes | None, ctype: str):
    import asyncio

    headers = {"Content-Type": "application/x-protobuf" if ctype == "proto" else "application/json"}
    return asyncio.run(client.request(method, path, content=body, headers=headers))


def _check_4xx(response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    err = response.json()["error"]
    assert err["code"] and err["message"] and "Traceback" not in response.text


@pytest.mark.parametrize(
    "method, path, body, ctype",
    [pytest.param(m, p, b, c, id=i) for i, m, p, b, c in BAD_INPUTS],
)
def test_bad_input_is_a_4xx(asgi_client, method, path, body, ctype):
    client, core = asgi_client
    before = {s.step_id for s in core.list_steps()}
    _check_4xx(_call(client, method, path, body, ctype))
    assert {s.step_id for s in core.list_steps()} == before  # nothing stored


_NESTED = st.integers(1, 150_000).map(_nested)
_HUGE_NUMBERS = st.one_of(
    st.integers(19, 500).map(lambda k: b"-" * (k % 2) + b"9" * k),
    st.integers(309, 1000).map(lambda k: f"1e{k}".encode()),
    st.integers(19, 400).map(lambda k: b"[1, " + b"7" * k + b", 2]"),
)
#: huge for every scalar field: beyond float32 (reward, advantage, weight are float32) and int32
_HUGE_SCALARS = st.one_of(
    st.integers(40, 500).map(lambda k: b"-" * (k % 2) + b"9" * k),
    st.integers(309, 1000).map(lambda k: f"1e{k}".encode()),
    st.integers(19, 400).map(lambda k: b"[1, " + b"7" * k + b", 2]"),
)
_ARRAYS = ["tokens", "loss_mask", "old_logprobs", "advantage"]
_SCALARS = ["reward", "advantage", "weight", "vocab_size"]


@pytest.mark.parametrize("where, fields, values", [
    pytest.param("rollout", _ARRAYS, _HUGE_NUMBERS.map(lambda v: b"[1, " + v + b", 2]"),
                 id="huge-numbers-in-rollout-arrays"),
    pytest.param("rollout", _SCALARS, _HUGE_SCALARS, id="huge-numbers-in-rollout-scalars"),
    pytest.param("rollout", _ARRAYS + _SCALARS, _NESTED, id="deep-nesting-in-rollouts"),
    pytest.param("plan", ["world_size", "microbatch_tokens", "memory_tokens", "chunk_size"],
                 st.one_of(_NESTED, _HUGE_NUMBERS), id="deep-nesting-and-huge-numbers-in-topologies"),
])
def test_deep_nesting_and_huge_numbers_never_cause_a_server_error(asgi_client, where, fields, values):
    client, _ = asgi_client

    @given(field=st.sampled_from(fields), value=values, n=st.integers(0, 10**9))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])  # no shrinking: bounded
    def fuzz(field, value, n):
        if where == "plan":
            body = b'{"world_size": 2, "' + field.encode() + b'": ' + value + b"}"
            _check_4xx(_call(client, "POST", f"/v1/steps/{STEP}/plan", body, "json"))
        else:
            _check_4xx(_call(client, "POST", "/v1/steps", _with(f"fz-{n}", field, value), "json"))

    fuzz()
