"""gRPC transport of the planner service (grpc.aio): harts.v1.Planner over `PlannerCore.aio`.

    health = add_to_server(grpc_server, core)     # Planner, grpc.health.v1 and reflection

Every harts.v1.Planner RPC needs metadata `authorization: Bearer <token>` when a token is
configured (health and reflection never do); errors map through `status_codes.STATUS`, with the
first offending field in the trailing metadata `harts-field`. FetchPlan sends the stored sealed
bytes verbatim; SubmitRollouts stores the `batch` bytes as they arrived and checks `body_sha256`
(DATA_LOSS); a cancelled call is counted as CANCELLED (docs/design/service.md).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from planner_service.core import PlannerCore
from planner_service.errors import AuthError, HartsError
from planner_service.transport.auth import bearer_ok
from planner_service.transport.status_codes import INTERNAL, status_of
from planner_service.wire_errors import field_bytes, wire_error
from proto.harts.v1 import planner_pb2

log = logging.getLogger(__name__)

__all__ = ["SERVICE", "add_to_server", "set_serving"]

SERVICE = planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name


class _Planner:
    """Handlers of harts.v1.Planner; each one authenticates, calls the core and maps errors."""

    def __init__(self, core: PlannerCore):
        self.core = core
        self.aio = core.aio
        self.token = core.cfg.token.encode() if core.cfg.token is not None else None

    def _check_token(self, context: grpc.aio.ServicerContext) -> None:
        if self.token is None:
            return
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
        if not bearer_ok(got, self.token):
            raise AuthError("authorization: expected metadata 'Bearer <token>' with the service's token")

    async def _run(self, operation: str, context: grpc.aio.ServicerContext, call):
        with self.core.metrics.request("grpc", operation) as box:
            try:
                self._check_token(context)
                return await call()
            except HartsError as exc:
                _, code = status_of(exc)
                box["code"] = code
                field = getattr(exc, "field", None)
                if field:
                    context.set_trailing_metadata((("harts-field", field),))
                await context.abort(getattr(grpc.StatusCode, code), exc.message)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                box["code"] = "CANCELLED"
                raise
            except Exception:
                log.exception("gRPC %s failed", operation)
                box["code"] = INTERNAL[1]
                await context.abort(grpc.StatusCode.INTERNAL, "internal error; the service log has the details")

    async def submit_rollouts(self, raw: bytes, context):
        async def call():
            req = _parse(planner_pb2.SubmitRolloutsRequest, raw)
            topology = req.topology if req.HasField("topology") else None
            # the batch's bytes as the client serialised them: stored and digested as they came
            batch = field_bytes(raw, planner_pb2.SubmitRolloutsRequest.BATCH_FIELD_NUMBER)
            return await self.aio.submit_message(req.batch, topology, body=batch, body_sha256=req.body_sha256)

        return await self._run("SubmitRollouts", context, call)

    async def plan_step(self, raw: bytes, context):
        async def call():
            req = _parse(planner_pb2.PlanStepRequest, raw)
            return await self.aio.plan(req.step_id, req.topology)

        return await self._run("PlanStep", context, call)

    async def fetch_plan(self, raw: bytes, context) -> bytes:
        async def call():
            req = _parse(planner_pb2.FetchPlanRequest, raw)
            return await self.aio.fetch(req.step_id, req.rank, req.wait_seconds)

        return await self._run("FetchPlan", context, call)

    async def get_status(self, raw: bytes, context):
        async def call():
            return await self.aio.status(_parse(planner_pb2.GetStatusRequest, raw).step_id)

        return await self._run("GetStatus", context, call)

    async def delete_step(self, raw: bytes, context):
        async def call():
            return await self.aio.delete(_parse(planner_pb2.DeleteStepRequest, raw).step_id)

        return await self._run("DeleteStep", context, call)

    async def list_steps(self, raw: bytes, context):
        async def call():
            limit = _parse(planner_pb2.ListStepsRequest, raw).limit
            return planner_pb2.ListStepsResponse(steps=await self.aio.list_steps(limit))

        return await self._run("ListSteps", context, call)


def _parse(cls, raw: bytes):
    """Request message from its bytes; parsed in the handler (after auth) so that a malformed
    request is INVALID_ARGUMENT rather than gRPC's own INTERNAL deserialisation error, naming the
    string field that is not UTF-8 when that is why (`batch.trajectories[2].id`)."""
    try:
        return cls.FromString(raw)
    except DecodeError:
        raise wire_error(cls, raw, "request") from None


def _verbatim(data: bytes) -> bytes:
    return data


def add_to_server(server: grpc.aio.Server, core: PlannerCore) -> health_aio.HealthServicer:
    """Register harts.v1.Planner, grpc.health.v1.Health (NOT_SERVING until `set_serving`) and reflection.

    Returns:
        the health servicer.
    """
    svc = _Planner(core)

    def unary(fn, serialize):
        # requests arrive as bytes (no request_deserializer): the handler parses them
        return grpc.unary_unary_rpc_method_handler(fn, response_serializer=serialize)

    handlers = {
        "SubmitRollouts": unary(svc.submit_rollouts, planner_pb2.SubmitRolloutsResponse.SerializeToString),
        "PlanStep": unary(svc.plan_step, planner_pb2.StepStatus.SerializeToString),
        "FetchPlan": unary(svc.fetch_plan, _verbatim),
        "GetStatus": unary(svc.get_status, planner_pb2.StepStatus.SerializeToString),
        "ListSteps": unary(svc.list_steps, planner_pb2.ListStepsResponse.SerializeToString),
        "DeleteStep": unary(svc.delete_step, planner_pb2.StepStatus.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    """Report the overall server and harts.v1.Planner as (not) serving."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await health.set(name, status)
