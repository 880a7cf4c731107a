"""The JSON bodies of the HTTP API (pydantic models): what OpenAPI documents and responses carry.

`Topology` (a plan request's body, strict: "2" is not a world size) and `SubmitQuery` (the query
of POST /v1/steps) are built from the one topology declaration, `planner_service.topology.FIELDS`;
the rollout document models (`RolloutBatchDoc` and its parts) are documentation only, since ingest
(`planner_service.ingest`) validates the body and names the first offending field.
See docs/design/service.md.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from planner_service.errors import ValidationError
from planner_service.topology import FIELDS, INT32, TopologyField
from planner_service.transport.api_docs import TOPOLOGY_EXAMPLES
from proto.harts.v1 import planner_pb2

__all__ = ["ErrorDetail", "ErrorBody", "Topology", "SubmitQuery", "PlanCandidate", "PlanStats", "StepStatus",
           "SubmitResponse", "StepList", "Health", "RolloutBatchDoc", "status_model"]


class ErrorDetail(BaseModel):
    code: str = Field(description="gRPC-style code name, e.g. INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS")
    message: str = Field(description="What is wrong and, where possible, how to fix it")
    field: str | None = Field(None, description="Path of the first offending field, e.g. trajectories[3].loss_mask")


class ErrorBody(BaseModel):
    error: ErrorDetail


def _field(f: TopologyField, *, optional: bool = False) -> tuple[Any, Any]:
    """The pydantic (annotation, Field) of a topology field: its bounds, its description, and
    its unset value as the default (a required field has none, or None if `optional`)."""
    bounds: dict[str, Any] = {}
    if f.type is int:
        bounds = {"ge": f.minimum, "le": f.maximum}
    elif f.type is str and f.maximum is not None:
        bounds = {"max_length": f.maximum}
    if f.required:
        if optional:
            return f.type | None, Field(None, description=f.description, **bounds)
        return f.type, Field(description=f.description, **bounds)
    return f.type, Field(f.type(), description=f.description, **bounds)


class _TopologyBody(BaseModel):
    # strict: "2", 2.0 or true are not a world size (a typo in a generator, not a number to coerce)
    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"examples": [e["value"] for e in TOPOLOGY_EXAMPLES.values()]})

    def to_proto(self) -> planner_pb2.Topology:
        return planner_pb2.Topology(**self.model_dump())


Topology = create_model(
    "Topology", __base__=_TopologyBody, __doc__="Trainer topology and budgets a step is planned for.",
    **{f.name: _field(f) for f in FIELDS})
"""The JSON body of POST /v1/steps/{step_id}/plan: every field of `planner_service.topology.FIELDS`."""


class _SubmitQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_proto(self) -> planner_pb2.Topology | None:
        """The topology to plan for at once (None: no world_size, plan later); ValidationError
        naming the first topology parameter given without world_size."""
        if self.world_size is not None:
            return planner_pb2.Topology(**self.model_dump())
        given = [name for name in type(self).model_fields if name in self.model_fields_set]
        if given:
            raise ValidationError(f"query.{given[0]}", "expected world_size with it (the step is planned at once only "
                                  "for a topology that names its world size), got no world_size")
        return None


SubmitQuery = create_model(
    "SubmitQuery", __base__=_SubmitQuery,
    __doc__="Query parameters of `POST /v1/steps`: the topology to plan the step for at once. An unknown "
            "parameter is refused (a misspelt `?worldsize=8` would leave the step unplanned while trainers "
            "wait), and so are topology parameters without `world_size`.",
    **{f.name: _field(f, optional=True) for f in FIELDS if not f.document})
"""Every field of the topology but its documents (a config.json does not belong in a URL)."""


class PlanCandidate(BaseModel):
    """One of the two lock-step plans the planner compared (plan.proto PlanCandidate)."""

    compression_achieved: float = 0.0
    makespan_ratio: float = 0.0
    lockstep_makespan: float = 0.0
    duplicated_tokens: int = 0
    cross_edges: int = 0
    exchanged_bytes: int = 0
    makespan: float = 0.0
    makespan_lower_bound: float = 0.0


class PlanStats(BaseModel):
    """The plan report (plan.proto PlanStats; every field, see its comments)."""

    unique_tokens: int
    expanded_tokens: int
    computed_tokens: int
    replay_tokens: int
    duplicated_tokens: int
    compression_ideal: float
    compression_achieved: float
    microbatches: int
    linear_attention_calls: int
    rank_costs: list[float]
    imbalance: float
    peak_live_tokens: int
    plan_seconds: float
    windows: int
    peak_live_bytes: int = 0
    makespan: float = 0.0
    makespan_lower_bound: float = 0.0
    makespan_ratio: float = 0.0
    lockstep_phases: int = Field(0, description="Lock-step plans: phases of the step (0: a free plan)")
    lockstep_makespan: float = 0.0
    lockstep_ratio: float = Field(0.0, description="lockstep_makespan / makespan (the free schedule's)")
    lockstep_forward_phases: int = 0
    lockstep_backward_phases: int = 0
    lockstep_recompute_phases: int = 0
    cross_edges: int = Field(0, description="Windows across ranks in the plan")
    exchanged_bytes: int = Field(0, description="Bytes the cross edges move per step (exports and their gradients)")
    max_rank_exchanged_bytes: int = 0
    rank_transfer_costs: list[float] = []
    with_cross_edges: PlanCandidate | None = Field(None, description="The candidate with windows across ranks")
    without_cross_edges: PlanCandidate | None = Field(None, description="The candidate without them")


def _message_fields(msg) -> dict:
    """A protobuf message's fields by name: repeated ones as lists, set sub-messages as dicts,
    unset ones left out (the model's default)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if f.is_repeated:
            out[f.name] = list(v)
        elif f.message_type is not None:
            if msg.HasField(f.name):
                out[f.name] = _message_fields(v)
        else:
            out[f.name] = v
    return out


class StepStatus(BaseModel):
    step_id: str
    state: Literal["submitted", "planned", "failed"]
    trajectories: int
    unique_tokens: int
    expanded_tokens: int
    stats: PlanStats | None = Field(None, description="Present once planned")
    topology: Topology | None = Field(None, description="Requested (submitted), planned or attempted (failed) topology")
    error: str | None = Field(None, description="Why planning failed")
    submitted_at: float = Field(description="Unix seconds")
    planned_at: float | None = Field(None, description="Unix seconds")


class SubmitResponse(BaseModel):
    status: StepStatus
    duplicate: bool = Field(description="True when the batch_id was already stored with the same content "
                            "(however it was serialised)")
    body_sha256: str = Field(description="Hex SHA-256 of the body the service received and stored (a duplicate's "
                             "stored batch was compared with it by content): the client compares it with the digest of "
                             "what it sent; a mismatch means the request or this answer was altered in transit")


class StepList(BaseModel):
    steps: list[StepStatus]


class Health(BaseModel):
    status: Literal["ok", "starting", "unavailable", "stopping"]
    reason: str | None = Field(None, description="Why the service is not ready (e.g. the storage fault)")


# The rollout document (docs/rollouts.md). Documentation only: the body is validated by
# planner_service.ingest, which names the first offending field.
class _TrajectoryFieldsDoc(BaseModel):
    """Per-position arrays (the trajectory's length) and per-trajectory scalars of both forms."""

    loss_mask: list[Literal[0, 1]] | None = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    advantage: float | list[float] = 0.0
    reward: float = 0.0
    group_id: str | None = None
    weight: float | None = Field(None, ge=0)


class TrajectoryDoc(_TrajectoryFieldsDoc):
    id: str
    tree_id: str | None = None
    tokens: list[int] = Field(min_length=1)


class TreeNodeDoc(BaseModel):
    id: int
    parent: int | None = None
    tokens: list[int] = Field(min_length=1)


class TreeTrajectoryDoc(_TrajectoryFieldsDoc):
    id: str
    node: int


class TreeDoc(BaseModel):
    id: str
    nodes: list[TreeNodeDoc]
    trajectories: list[TreeTrajectoryDoc]


class RolloutBatchDoc(BaseModel):
    """One training step's rollouts (docs/rollouts.md); flat and explicit-tree forms may be mixed."""

    batch_id: str = Field(min_length=1, max_length=512, pattern="^[^/]+$",
                          description="Idempotency key of the step; the same content under the same id is a "
                          "duplicate. It is a URL path segment: no '/', not '.' or '..', no control characters, "
                          "not only whitespace")
    vocab_size: int = Field(ge=1, le=INT32)
    trajectories: list[TrajectoryDoc] = []
    trees: list[TreeDoc] = []
    policy_version: int | None = Field(default=None, ge=0, le=(1 << 63) - 1,
                                       description="Version of the policy that sampled the batch (staleness bound)")


_STATE = {
    planner_pb2.STEP_STATE_SUBMITTED: "submitted",
    planner_pb2.STEP_STATE_PLANNED: "planned",
    planner_pb2.STEP_STATE_FAILED: "failed",
}


def status_model(st: planner_pb2.StepStatus) -> StepStatus:
    """JSON view of a StepStatus message."""
    stats = None
    if st.HasField("stats"):
        stats = PlanStats(**_message_fields(st.stats))
    topo = None
    if st.HasField("topology"):
        topo = Topology.model_construct(**{f.name: getattr(st.topology, f.name) for f in st.topology.DESCRIPTOR.fields})
    return StepStatus(
        step_id=st.step_id,
        state=_STATE[st.state],
        trajectories=st.trajectories,
        unique_tokens=st.unique_tokens,
        expanded_tokens=st.expanded_tokens,
        stats=stats,
        topology=topo,
        error=st.error or None,
        submitted_at=st.submitted_at,
        planned_at=st.planned_at or None,
    )
