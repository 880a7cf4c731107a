"""HTTP transport of the planner service (FastAPI, OpenAPI at /docs): a thin adapter over `PlannerCore.aio`.

    app = create_app(core)       # the routes of `router`, the token gate, the error handlers, /docs

Routes: POST /v1/steps (JSON or protobuf; a topology in the query plans at once;
`X-Harts-Body-Sha256` checks the body), POST /v1/steps/{step_id}/plan, GET
/v1/steps/{step_id}/ranks/{rank}/plan (sealed bytes, `X-Harts-Checksum`, ?wait= long-polls),
GET and DELETE /v1/steps/{step_id}, GET /v1/steps, /healthz, /readyz, /metrics. Bodies are read
with the size limit (`_read_body`); errors are `http_errors.py`'s (docs/design/service.md).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import ClientDisconnect

from planner_service.core import PlannerCore
from planner_service.core.metrics import CONTENT_TYPE_LATEST
from planner_service.errors import LimitError, ValidationError
from planner_service.topology import INT32
from planner_service.transport.api_docs import ROLLOUT_EXAMPLES, TOPOLOGY_EXAMPLES, add_docs
from planner_service.transport.auth import TokenGate
from planner_service.transport.http_errors import HANDLERS, responses
from planner_service.transport.http_models import (
    Health,
    RolloutBatchDoc,
    StepList,
    StepStatus,
    SubmitQuery,
    SubmitResponse,
    Topology,
    status_model,
)
from planner_service.transport.status_codes import RETRY_AFTER_SECONDS
from proto.harts.v1 import plan_pb2

log = logging.getLogger(__name__)

__all__ = ["create_app", "router", "PROTOBUF", "BODY_SHA256_HEADER", "slice_checksum"]

PROTOBUF = "application/x-protobuf"
BODY_SHA256_HEADER = "X-Harts-Body-Sha256"
"""Request header of POST /v1/steps: the client's SHA-256 of the body (SubmitRolloutsRequest.body_sha256)."""
_PROTO_TYPES = {PROTOBUF, "application/protobuf", "application/vnd.google.protobuf", "application/octet-stream"}
_TOPOLOGY_BYTES = 4 * 1024 * 1024
"""Largest plan request body: a topology with its model and cost-model documents (1 MiB each)."""

def slice_checksum(data: bytes) -> str:
    """The checksum field of sealed PlanSlice bytes.

    Deterministic serialisation writes fields in number order, so a sealed slice ends with field 3
    (tag 0x1a, length 64, 64 hex digits); anything else is parsed.
    """
    if len(data) >= 66 and data[-66:-64] == b"\x1a\x40":
        return data[-64:].decode("ascii")
    return plan_pb2.PlanSlice.FromString(data).checksum


async def _read_body(request: Request, limit: int) -> bytearray:
    """The request body in one buffer, refusing (413) a declared Content-Length over `limit` before
    reading anything, and a streamed body as soon as it passes `limit`."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise LimitError(f"request: expected at most {limit} bytes, got {size} (Content-Length)")
    body = bytearray(size or 0)  # one allocation of the declared size: no list of chunks, no join
    n = 0
    async for chunk in request.stream():
        end = n + len(chunk)
        if end > limit:
            raise LimitError(f"request: expected at most {limit} bytes, got more")
        if end <= len(body):
            body[n:end] = chunk
        else:
            del body[n:]
            body += chunk
        n = end
    del body[n:]
    return body


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (ClientDisconnect) when the client goes away first (long-polls)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnect()


class _Measure:
    """ASGI middleware: request count and latency per route name and status (a plain ASGI wrapper,
    cheaper than Starlette's BaseHTTPMiddleware on the hot fetch path)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            op = getattr(route, "name", None) or "unmatched"
            self.metrics.latency.labels("http", op).observe(time.perf_counter() - t0)
            self.metrics.requests.labels("http", op, str(status)).inc()


def _core(request: Request) -> PlannerCore:
    """The service core of the application serving `request` (set by `create_app`)."""
    return request.app.state.core


_bearer = HTTPBearer(auto_error=False, description="Bearer token configured with `harts serve --token`")


async def _bearer_scheme(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """Declares the bearer scheme of a route in the OpenAPI document; `TokenGate` has checked
    the token before the route runs."""


_AUTH = [Depends(_bearer_scheme)]

router = APIRouter()
"""Every route of the service; `create_app` mounts it on an application bound to one core."""

# ---- health and metrics


@router.get("/healthz", response_model=Health, response_model_exclude_none=True, tags=["health"], name="healthz")
async def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, response_model_exclude_none=True, tags=["health"], name="readyz",
            responses={503: {"model": Health, "description": "Starting, stopping, or the database cannot be "
                             "written (`reason` says why)"}})
async def readyz(core: PlannerCore = Depends(_core)):
    """Readiness: Numba code compiled, interrupted plans resumed, and the database writable."""
    ready, reason = core.readiness()
    if ready:
        return Health(status="ok")
    status = "starting" if reason.startswith("starting") else "stopping" if reason == "stopping" else "unavailable"
    return JSONResponse(Health(status=status, reason=reason).model_dump(exclude_none=True), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


@router.get("/metrics", tags=["health"], name="metrics", dependencies=_AUTH, response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}, **responses(401)})
async def metrics(core: PlannerCore = Depends(_core)):
    """Prometheus metrics: request counts and latency, ingest bytes, plan seconds, compression, waiting steps."""
    return Response(core.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- steps


@router.post(
    "/v1/steps",
    response_model=SubmitResponse,
    tags=["steps"],
    name="submit_rollouts",
    dependencies=_AUTH,
    responses=responses(400, 401, 408, 409, 413, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The rollout document (docs/rollouts.md) as JSON, or a serialised "
            "harts.v1.RolloutBatch with Content-Type: application/x-protobuf.",
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/RolloutBatchDoc"},
                                     "examples": ROLLOUT_EXAMPLES},
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def submit_rollouts(
    request: Request,
    query: Annotated[SubmitQuery, Query()],
    body_sha256: str = Header("", alias=BODY_SHA256_HEADER, max_length=128, description=(
        "Hex SHA-256 of the body as the client sends it: a body that arrives otherwise is refused (400 "
        "DATA_LOSS, nothing stored; send it again). The response's body_sha256 is the digest of what was received")),
    core: PlannerCore = Depends(_core),
) -> SubmitResponse:
    """Store a step's rollouts: validated whole, idempotent by batch_id and content.

    The same batch_id with the same content (in any JSON spelling, or as protobuf) is a
    duplicate; with other content, a conflict (409). With `world_size` (or a service default
    topology) the step is planned at once, in the background; trainers long-poll their slice.
    An unknown query parameter, or a topology parameter without `world_size`, is a 422 naming it.
    """
    topology = query.to_proto()
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype in _PROTO_TYPES:
        fmt = "proto"
    elif ctype in ("application/json", "text/json", "") or ctype.endswith("+json"):
        fmt = "json"
    else:
        raise ValidationError("Content-Type", f"expected application/json or {PROTOBUF}, got {ctype!r}")
    body = await _read_body(request, core.cfg.max_request_bytes)
    resp = await core.aio.submit(body, fmt, topology, body_sha256=body_sha256)
    return SubmitResponse(status=status_model(resp.status), duplicate=resp.duplicate, body_sha256=resp.body_sha256)


@router.post("/v1/steps/{step_id}/plan", response_model=StepStatus, tags=["steps"], name="plan_step",
             dependencies=_AUTH, responses=responses(400, 401, 404, 409, 413, 422, 503),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/Topology"}, "examples": TOPOLOGY_EXAMPLES}}}})
async def plan_step(request: Request, step_id: str = Path(min_length=1),
                    core: PlannerCore = Depends(_core)) -> StepStatus:
    """Plan (or, after a failure, re-plan) a stored step; idempotent for the same topology."""
    body = await _read_body(request, min(core.cfg.max_request_bytes, _TOPOLOGY_BYTES))
    try:
        topology = Topology.model_validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(["body", *(str(p) for p in first.get("loc", ()))])
        if first.get("type") == "json_invalid":
            raise ValidationError("body", f"expected a JSON topology object, got invalid JSON ({first.get('msg')})") from None
        raise ValidationError(field, first.get("msg", "invalid")) from None
    return status_model(await core.aio.plan(step_id, topology.to_proto()))


@router.get(
    "/v1/steps/{step_id}/ranks/{rank}/plan",
    tags=["steps"],
    name="fetch_plan",
    dependencies=_AUTH,
    response_class=Response,
    responses={
        200: {
            "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
            "description": "Sealed harts.v1.PlanSlice bytes, identical on every retry; the "
            "X-Harts-Checksum header repeats its checksum",
            "headers": {"X-Harts-Checksum": {"schema": {"type": "string"}, "description": "hex SHA-256"}},
        },
        **responses(400, 401, 404, 422, 503),
    },
)
async def fetch_plan(
    request: Request,
    step_id: str = Path(min_length=1),
    rank: int = Path(ge=0, le=65535),
    wait: float = Query(0.0, ge=0.0, le=3600.0, description="Long-poll: seconds to wait for the plan"),
    core: PlannerCore = Depends(_core),
):
    """One rank's plan slice; with `wait` the request returns as soon as the step is planned."""
    if wait > 0:
        data = await _unless_disconnected(request, core.aio.fetch(step_id, rank, wait))
    else:
        data = await core.aio.fetch(step_id, rank, wait)
    return Response(data, media_type=PROTOBUF, headers={"X-Harts-Checksum": slice_checksum(data)})


@router.get("/v1/steps/{step_id}", response_model=StepStatus, tags=["steps"], name="get_status",
            dependencies=_AUTH, responses=responses(401, 404, 503))
async def get_status(step_id: str = Path(min_length=1), core: PlannerCore = Depends(_core)) -> StepStatus:
    """State, token counts, topology and (once planned) the plan report of a step."""
    return status_model(await core.aio.status(step_id))


@router.delete("/v1/steps/{step_id}", response_model=StepStatus, tags=["steps"], name="delete_step",
               dependencies=_AUTH, responses=responses(401, 404, 503))
async def delete_step(step_id: str = Path(min_length=1), core: PlannerCore = Depends(_core)) -> StepStatus:
    """Delete a step with its rollouts and plan (a plan in progress finishes first); returns the
    step as it was. Its batch_id may then be submitted again, as a new step. `harts serve
    --retain-steps / --max-age` delete old steps automatically."""
    return status_model(await core.aio.delete(step_id))


@router.get("/v1/steps", response_model=StepList, tags=["steps"], name="list_steps",
            dependencies=_AUTH, responses=responses(401, 422, 503))
async def list_steps(limit: int = Query(0, ge=0, le=INT32, description="At most this many (0: default)"),
                     core: PlannerCore = Depends(_core)) -> StepList:
    """Steps, newest submission first."""
    return StepList(steps=[status_model(s) for s in await core.aio.list_steps(limit)])


def _openapi_with_rollout_schema(app: FastAPI):
    """`app.openapi` that adds the rollout document's schema (documentation only: ingest validates
    the body) under components/schemas/RolloutBatchDoc, once."""
    batch_schema = RolloutBatchDoc.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = batch_schema.pop("$defs", {})
    generate = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = generate()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.update(defs)
            comps["RolloutBatchDoc"] = batch_schema
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_app(core: PlannerCore) -> FastAPI:
    """The FastAPI application of one service instance (core owned by the caller)."""
    app = FastAPI(
        title="HARTS planner service",
        version="1",
        description=(
            "Ingests rollout trees, plans prefix-sharing microbatches and serves each trainer rank its "
            "sealed plan slice. The gRPC service harts.v1.Planner offers the same operations."
        ),
        docs_url=None,
        redoc_url=None,
    )
    add_docs(app)
    app.state.core = core
    for exc_type, handler in HANDLERS:
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(TokenGate, token=core.cfg.token)
    app.add_middleware(_Measure, metrics=core.metrics)
    app.include_router(router)
    app.openapi = _openapi_with_rollout_schema(app)
    return app
