from proto.harts.v1 import plan_pb2 as _plan_pb2
from proto.harts.v1 import rollouts_pb2 as _rollouts_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATE_UNSPECIFIED: _ClassVar[StepState]
    STEP_STATE_SUBMITTED: _ClassVar[StepState]
    STEP_STATE_PLANNED: _ClassVar[StepState]
    STEP_STATE_FAILED: _ClassVar[StepState]
STEP_STATE_UNSPECIFIED: StepState
STEP_STATE_SUBMITTED: StepState
STEP_STATE_PLANNED: StepState
STEP_STATE_FAILED: StepState

class Topology(_message.Message):
    __slots__ = ("world_size", "microbatch_tokens", "memory_tokens", "chunk_size", "no_sharing", "no_windows", "model", "dtype", "cost_model", "lockstep", "no_cross_rank_windows", "activation_checkpointing", "expert_parallel", "head")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NO_SHARING_FIELD_NUMBER: _ClassVar[int]
    NO_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_FIELD_NUMBER: _ClassVar[int]
    NO_CROSS_RANK_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    microbatch_tokens: int
    memory_tokens: int
    chunk_size: int
    no_sharing: bool
    no_windows: bool
    model: str
    dtype: str
    cost_model: str
    lockstep: bool
    no_cross_rank_windows: bool
    activation_checkpointing: str
    expert_parallel: int
    head: str
    def __init__(self, world_size: _Optional[int] = ..., microbatch_tokens: _Optional[int] = ..., memory_tokens: _Optional[int] = ..., chunk_size: _Optional[int] = ..., no_sharing: _Optional[bool] = ..., no_windows: _Optional[bool] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., cost_model: _Optional[str] = ..., lockstep: _Optional[bool] = ..., no_cross_rank_windows: _Optional[bool] = ..., activation_checkpointing: _Optional[str] = ..., expert_parallel: _Optional[int] = ..., head: _Optional[str] = ...) -> None: ...

class StepStatus(_message.Message):
    __slots__ = ("step_id", "state", "trajectories", "unique_tokens", "expanded_tokens", "stats", "topology", "error", "submitted_at", "planned_at")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AT_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    state: StepState
    trajectories: int
    unique_tokens: int
    expanded_tokens: int
    stats: _plan_pb2.PlanStats
    topology: Topology
    error: str
    submitted_at: float
    planned_at: float
    def __init__(self, step_id: _Optional[str] = ..., state: _Optional[_Union[StepState, str]] = ..., trajectories: _Optional[int] = ..., unique_tokens: _Optional[int] = ..., expanded_tokens: _Optional[int] = ..., stats: _Optional[_Union[_plan_pb2.PlanStats, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., error: _Optional[str] = ..., submitted_at: _Optional[float] = ..., planned_at: _Optional[float] = ...) -> None: ...

class SubmitRolloutsRequest(_message.Message):
    __slots__ = ("batch", "topology", "body_sha256")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    BODY_SHA256_FIELD_NUMBER: _ClassVar[int]
    batch: _rollouts_pb2.RolloutBatch
    topology: Topology
    body_sha256: str
    def __init__(self, batch: _Optional[_Union[_rollouts_pb2.RolloutBatch, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., body_sha256: _Optional[str] = ...) -> None: ...

class SubmitRolloutsResponse(_message.Message):
    __slots__ = ("status", "duplicate", "body_sha256")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BODY_SHA256_FIELD_NUMBER: _ClassVar[int]
    status: StepStatus
    duplicate: bool
    body_sha256: str
    def __init__(self, status: _Optional[_Union[StepStatus, _Mapping]] = ..., duplicate: _Optional[bool] = ..., body_sha256: _Optional[str] = ...) -> None: ...

class PlanStepRequest(_message.Message):
    __slots__ = ("step_id", "topology")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    topology: Topology
    def __init__(self, step_id: _Optional[str] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ...) -> None: ...

class FetchPlanRequest(_message.Message):
    __slots__ = ("step_id", "rank", "wait_seconds")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    rank: int
    wait_seconds: float
    def __init__(self, step_id: _Optional[str] = ..., rank: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    def __init__(self, step_id: _Optional[str] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepStatus]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepStatus, _Mapping]]] = ...) -> None: ...

class DeleteStepRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    def __init__(self, step_id: _Optional[str] = ...) -> None: ...
