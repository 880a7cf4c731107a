"""The gRPC API of a real `harts serve` subprocess: harts.v1.Planner, health, reflection, auth."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from planner_service.ingest import json_to_proto
from planner_service.server import ServerProcess
from proto.harts.v1 import planner_pb2, planner_pb2_grpc, rollouts_pb2
from plan.seal import open_sealed
from tests.service_helpers import TOPOLOGY, rollout_doc

pytestmark = pytest.mark.integration

TOKEN = "grpc-token-h4"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
TOPO = planner_pb2.Topology(**TOPOLOGY)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("grpc") / "planner.db", token=TOKEN, extra=["--max-request-mb", "1"]).start()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_text()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return planner_pb2_grpc.PlannerStub(channel)


def test_health_and_reflection_need_no_token(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "harts.v1.Planner"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"harts.v1.Planner", "grpc.health.v1.Health"} <= names


def test_every_planner_rpc_needs_the_token(stub):
    calls = [
        (stub.GetStatus, planner_pb2.GetStatusRequest(step_id="x")),
        (stub.ListSteps, planner_pb2.ListStepsRequest()),
        (stub.FetchPlan, planner_pb2.FetchPlanRequest(step_id="x")),
        (stub.PlanStep, planner_pb2.PlanStepRequest(step_id="x", topology=TOPO)),
        (stub.SubmitRollouts, planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("s-na")))),
    ]
    for fn, req in calls:
        for md in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                fn(req, metadata=md, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_submit_plan_fetch_over_grpc_matches_http(server, channel, stub):
    batch = json_to_proto(rollout_doc("g-step", seed=7))
    resp = stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=batch, topology=TOPO), metadata=AUTH, timeout=10)
    assert not resp.duplicate and resp.status.step_id == "g-step"
    again = stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=batch), metadata=AUTH, timeout=10)
    assert again.duplicate
    raw_fetch = channel.unary_unary("/harts.v1.Planner/FetchPlan",
                                    request_serializer=planner_pb2.FetchPlanRequest.SerializeToString)
    raw = raw_fetch(planner_pb2.FetchPlanRequest(step_id="g-step", rank=1, wait_seconds=10), metadata=AUTH, timeout=20)
    sl = open_sealed(raw)
    assert sl.rank.rank == 1
    parsed = stub.FetchPlan(planner_pb2.FetchPlanRequest(step_id="g-step", rank=1), metadata=AUTH, timeout=5)
    assert parsed == sl
    http = httpx.get(f"{server.http_url}/v1/steps/g-step/ranks/1/plan", headers={"Authorization": f"Bearer {TOKEN}"})
    assert http.content == raw
    st = stub.GetStatus(planner_pb2.GetStatusRequest(step_id="g-step"), metadata=AUTH, timeout=5)
    assert st.state == planner_pb2.STEP_STATE_PLANNED and st.stats.microbatches >= 1
    same = stub.PlanStep(planner_pb2.PlanStepRequest(step_id="g-step", topology=TOPO), metadata=AUTH, timeout=10)
    assert same.planned_at == st.planned_at
    steps = stub.ListSteps(planner_pb2.ListStepsRequest(limit=10), metadata=AUTH, timeout=5).steps
    assert "g-step" in [s.step_id for s in steps]


def test_error_codes(stub):
    bad = json_to_proto(rollout_doc("g-bad"))
    bad.trajectories[2].loss_mask = bad.trajectories[2].loss_mask[:-1]
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=bad), metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trajectories[2].loss_mask" in err.value.details()
    assert ("harts-field", "trajectories[2].loss_mask") in tuple(err.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as err:
        stub.GetStatus(planner_pb2.GetStatusRequest(step_id="missing"), metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-wait"))), metadata=AUTH, timeout=5)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        stub.FetchPlan(planner_pb2.FetchPlanRequest(step_id="g-wait", wait_seconds=0.3), metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.perf_counter() - t0 >= 0.25
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(planner_pb2.PlanStepRequest(step_id="g-wait", topology=planner_pb2.Topology(world_size=0)),
                      metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "topology.world_size" in err.value.details()
    huge = planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-huge")))
    huge.batch.trajectories[0].tokens = b"\0" * (2 << 20)
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitRollouts(huge, metadata=AUTH, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_malformed_request_bytes_are_invalid_argument(channel):
    raw_status = channel.unary_unary("/harts.v1.Planner/GetStatus")  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as err:
        raw_status(b"\xff\xff\xff\xff", metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GetStatusRequest" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # auth is checked before the bytes are looked at
        raw_status(b"\xff\xff\xff\xff", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_wait_seconds_nan_is_invalid_argument(stub):
    t0 = time.perf_counter()
    for wait in (float("nan"), -1.0, float("inf")):
        with pytest.raises(grpc.RpcError) as err:
            stub.FetchPlan(planner_pb2.FetchPlanRequest(step_id="g-nan", wait_seconds=wait), metadata=AUTH, timeout=3)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "wait_seconds" in err.value.details()
    assert time.perf_counter() - t0 < 2


def test_default_microbatch_tokens_is_the_same_over_grpc_and_http(server, stub):
    for step in ("g-mb", "h-mb"):
        stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc(step))), metadata=AUTH,
                            timeout=5)
    # neither names microbatch_tokens: gRPC sends 0, HTTP omits the field
    st = stub.PlanStep(planner_pb2.PlanStepRequest(step_id="g-mb", topology=planner_pb2.Topology(
        world_size=2, chunk_size=16)), metadata=AUTH, timeout=10)
    http = httpx.post(f"{server.http_url}/v1/steps/h-mb/plan", json={"world_size": 2, "chunk_size": 16},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert http.status_code == 200, http.text
    assert st.state == planner_pb2.STEP_STATE_PLANNED
    assert st.topology.microbatch_tokens == http.json()["topology"]["microbatch_tokens"] == 4096


def _requests(server, operation: str) -> dict[str, float]:
    import re

    text = httpx.get(f"{server.http_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    pattern = rf'harts_requests_total{{code="(\w+)",operation="{operation}",transport="grpc"}} (\S+)'
    return {code: float(n) for code, n in re.findall(pattern, text)}


def test_cancelled_calls_are_not_counted_ok(server, stub):
    before = _requests(server, "FetchPlan")
    with pytest.raises(grpc.RpcError) as err:  # the client gives up long before the server's wait
        stub.FetchPlan(planner_pb2.FetchPlanRequest(step_id="g-cancel", wait_seconds=10), metadata=AUTH, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while _requests(server, "FetchPlan").get("CANCELLED", 0) <= before.get("CANCELLED", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = _requests(server, "FetchPlan")
    assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1
    assert after.get("OK", 0) == before.get("OK", 0)


def test_delete_step(stub, channel):
    stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-del")), topology=TOPO),
                        metadata=AUTH, timeout=5)
    delete = channel.unary_unary("/harts.v1.Planner/DeleteStep",
                                 request_serializer=planner_pb2.GetStatusRequest.SerializeToString,
                                 response_deserializer=planner_pb2.StepStatus.FromString)
    with pytest.raises(grpc.RpcError) as err:
        delete(planner_pb2.GetStatusRequest(step_id="g-del"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    st = delete(planner_pb2.GetStatusRequest(step_id="g-del"), metadata=AUTH, timeout=5)
    assert st.step_id == "g-del" and st.trajectories == 6
    for call in (lambda: stub.GetStatus(planner_pb2.GetStatusRequest(step_id="g-del"), metadata=AUTH, timeout=5),
                 lambda: delete(planner_pb2.GetStatusRequest(step_id="g-del"), metadata=AUTH, timeout=5)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---- the last hostile-audit defects, each from its reproducer


def test_a_long_step_id_is_invalid_argument_not_an_oversized_trailer(stub):
    for call, req in ((stub.GetStatus, planner_pb2.GetStatusRequest(step_id="x" * 9000)),
                      (stub.FetchPlan, planner_pb2.FetchPlanRequest(step_id="x" * 9000)),
                      (stub.DeleteStep, planner_pb2.DeleteStepRequest(step_id="x" * 9000))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, metadata=AUTH, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "step_id: expected at most 512 characters, got 9000" in err.value.details()


def test_ids_that_are_not_utf8_and_huge_memory_budgets_name_their_field(channel, stub):
    raw_submit = channel.unary_unary("/harts.v1.Planner/SubmitRollouts")
    req = planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-utf8")))
    data = req.SerializeToString().replace(b"g-utf8-t3", b"g-utf8-\xff3")
    with pytest.raises(grpc.RpcError) as err:
        raw_submit(data, metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("harts-field", "batch.trajectories[3].id") in tuple(err.value.trailing_metadata()), err.value.details()
    raw_status = channel.unary_unary("/harts.v1.Planner/GetStatus")
    with pytest.raises(grpc.RpcError) as err:
        raw_status(planner_pb2.GetStatusRequest(step_id="ab").SerializeToString().replace(b"ab", b"a\xc3"),
                   metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("step_id:")
    huge = planner_pb2.Topology(world_size=2, memory_tokens=2**62)
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-mem")), topology=huge),
                            metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "topology.memory_tokens" in err.value.details()


def test_a_lockstep_topology_is_kept_with_the_step(stub):
    topo = planner_pb2.Topology(**TOPOLOGY, lockstep=True)
    st = stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-lock")), topology=topo),
                             metadata=AUTH, timeout=10).status
    assert st.topology.lockstep
    assert stub.GetStatus(planner_pb2.GetStatusRequest(step_id="g-lock"), metadata=AUTH, timeout=5).topology.lockstep


def test_a_kilobyte_topology_with_too_many_layers_is_refused_and_reads_keep_answering(server, stub):
    """The hostile audit's reproducers: six concurrent 1 KB SubmitRollouts whose
    topology's model has 3 x 10^5 layers filled the default worker threads (a status GET took
    29.9 s), and a PlanStep with 10^7 layers (a 930-byte document) held the planning thread 271 s.
    Both are refused at once, naming the field and the bound, and nothing is stored."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from plan.named_models import qwen3_next_80b_a3b

    def topology(layers: int) -> planner_pb2.Topology:
        model = {k: v for k, v in qwen3_next_80b_a3b().items() if k not in ("architectures", "rope_theta")}
        model["num_hidden_layers"] = layers
        return planner_pb2.Topology(**TOPOLOGY, model=json.dumps(model))

    stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc("g-layers"))),
                        metadata=AUTH, timeout=10)
    wide = topology(3 * 10**5)
    assert wide.ByteSize() < 1024

    def submit(i: int):
        req = planner_pb2.SubmitRolloutsRequest(batch=json_to_proto(rollout_doc(f"g-layers-{i}", trajectories=2)),
                                                topology=wide)
        try:
            stub.SubmitRollouts(req, metadata=AUTH, timeout=60)
        except grpc.RpcError as err:
            return err.code(), dict(err.trailing_metadata()).get("harts-field"), err.details()
        return None

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(submit, range(6)))
        st = stub.GetStatus(planner_pb2.GetStatusRequest(step_id="g-layers"), metadata=AUTH, timeout=60)
    assert st.step_id == "g-layers"
    for code, field, details in answers:
        assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "topology.model.num_hidden_layers"), details
        assert "expected an integer in [1, 1024], got 300000" in details
    deep = topology(10**7)
    assert deep.ByteSize() < 1024
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(planner_pb2.PlanStepRequest(step_id="g-layers", topology=deep), metadata=AUTH, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got 10000000" in err.value.details()
    http = httpx.post(f"{server.http_url}/v1/steps/g-layers/plan", timeout=60, headers={"Authorization": f"Bearer {TOKEN}"},
                      json={"world_size": 2, "model": deep.model})
    assert http.status_code == 422 and http.json()["error"]["field"] == "topology.model.num_hidden_layers", http.text
    names = {s.step_id for s in stub.ListSteps(planner_pb2.ListStepsRequest(limit=100), metadata=AUTH, timeout=5).steps}
    assert not any(n.startswith("g-layers-") for n in names)


def test_the_batch_bytes_are_digested_as_they_arrived_and_other_bytes_are_data_loss(channel, stub):
    """The answer's body_sha256 is the SHA-256 of the request's batch bytes as the client
    serialised them; a request whose body_sha256 names other bytes stores nothing."""
    import hashlib

    batch = json_to_proto(rollout_doc("g-digest", seed=21))
    raw = batch.SerializeToString()
    digest = hashlib.sha256(raw).hexdigest()
    wrong = hashlib.sha256(raw + b"x").hexdigest()
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=batch, body_sha256=wrong), metadata=AUTH, timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and ("harts-field", "body_sha256") in err.value.trailing_metadata()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetStatus(planner_pb2.GetStatusRequest(step_id="g-digest"), metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # nothing stored
    resp = stub.SubmitRollouts(planner_pb2.SubmitRolloutsRequest(batch=batch, body_sha256=digest), metadata=AUTH,
                               timeout=10)
    assert resp.body_sha256 == digest and not resp.duplicate
    # the batch split in two occurrences of field 1 (protobuf merges them): the bytes as they came
    half = len(batch.trajectories) // 2
    first, second = rollouts_pb2.RolloutBatch(batch_id="g-digest-2", vocab_size=batch.vocab_size), rollouts_pb2.RolloutBatch()
    first.trajectories.extend(batch.trajectories[:half])
    second.trajectories.extend(batch.trajectories[half:])
    field = planner_pb2.SubmitRolloutsRequest(batch=first).SerializeToString() + \
        planner_pb2.SubmitRolloutsRequest(batch=second).SerializeToString()
    raw_submit = channel.unary_unary("/harts.v1.Planner/SubmitRollouts",
                                     response_deserializer=planner_pb2.SubmitRolloutsResponse.FromString)
    sent = first.SerializeToString() + second.SerializeToString()
    resp = raw_submit(field, metadata=AUTH, timeout=10)
    assert resp.body_sha256 == hashlib.sha256(sent).hexdigest() and resp.status.trajectories == len(batch.trajectories)
