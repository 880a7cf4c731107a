from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogprobPositions(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_POSITIONS_LOSS: _ClassVar[LogprobPositions]
    LOGPROB_POSITIONS_ALL: _ClassVar[LogprobPositions]

class PhaseKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_FORWARD: _ClassVar[PhaseKind]
    PHASE_BACKWARD: _ClassVar[PhaseKind]
    PHASE_RECOMPUTE: _ClassVar[PhaseKind]
LOGPROB_POSITIONS_LOSS: LogprobPositions
LOGPROB_POSITIONS_ALL: LogprobPositions
PHASE_FORWARD: PhaseKind
PHASE_BACKWARD: PhaseKind
PHASE_RECOMPUTE: PhaseKind

class PlanParams(_message.Message):
    __slots__ = ("world_size", "microbatch_tokens", "memory_tokens", "chunk_size", "conv_kernel", "vocab_size", "sharing", "windows", "replay", "logprob_positions", "memory", "cost_model", "lockstep", "cross_rank_windows")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONV_KERNEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    microbatch_tokens: int
    memory_tokens: int
    chunk_size: int
    conv_kernel: int
    vocab_size: int
    sharing: bool
    windows: bool
    replay: bool
    logprob_positions: LogprobPositions
    memory: MemoryModel
    cost_model: CostModel
    lockstep: bool
    cross_rank_windows: bool
    def __init__(self, world_size: _Optional[int] = ..., microbatch_tokens: _Optional[int] = ..., memory_tokens: _Optional[int] = ..., chunk_size: _Optional[int] = ..., conv_kernel: _Optional[int] = ..., vocab_size: _Optional[int] = ..., sharing: _Optional[bool] = ..., windows: _Optional[bool] = ..., replay: _Optional[bool] = ..., logprob_positions: _Optional[_Union[LogprobPositions, str]] = ..., memory: _Optional[_Union[MemoryModel, _Mapping]] = ..., cost_model: _Optional[_Union[CostModel, _Mapping]] = ..., lockstep: _Optional[bool] = ..., cross_rank_windows: _Optional[bool] = ...) -> None: ...

class MemoryModel(_message.Message):
    __slots__ = ("activation_row_bytes", "attn_row_bytes", "conv_row_bytes", "kernel_row_bytes", "state_bytes", "memory_bytes", "model", "dtype", "recompute_row_bytes", "activation_checkpointing", "head")
    ACTIVATION_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTN_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONV_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    activation_row_bytes: int
    attn_row_bytes: int
    conv_row_bytes: int
    kernel_row_bytes: int
    state_bytes: int
    memory_bytes: int
    model: str
    dtype: str
    recompute_row_bytes: int
    activation_checkpointing: str
    head: str
    def __init__(self, activation_row_bytes: _Optional[int] = ..., attn_row_bytes: _Optional[int] = ..., conv_row_bytes: _Optional[int] = ..., kernel_row_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., recompute_row_bytes: _Optional[int] = ..., activation_checkpointing: _Optional[str] = ..., head: _Optional[str] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("row", "attention", "linear_call", "logprob_row", "source", "transfer_byte")
    ROW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    LINEAR_CALL_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROW_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTE_FIELD_NUMBER: _ClassVar[int]
    row: float
    attention: float
    linear_call: float
    logprob_row: float
    source: str
    transfer_byte: float
    def __init__(self, row: _Optional[float] = ..., attention: _Optional[float] = ..., linear_call: _Optional[float] = ..., logprob_row: _Optional[float] = ..., source: _Optional[str] = ..., transfer_byte: _Optional[float] = ...) -> None: ...

class StateSource(_message.Message):
    __slots__ = ("kind", "state")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ZERO: _ClassVar[StateSource.Kind]
        LOCAL: _ClassVar[StateSource.Kind]
        IMPORTED: _ClassVar[StateSource.Kind]
    ZERO: StateSource.Kind
    LOCAL: StateSource.Kind
    IMPORTED: StateSource.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    kind: StateSource.Kind
    state: int
    def __init__(self, kind: _Optional[_Union[StateSource.Kind, str]] = ..., state: _Optional[int] = ...) -> None: ...

class StateExport(_message.Message):
    __slots__ = ("state", "depth")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    state: int
    depth: int
    def __init__(self, state: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class LinearSequence(_message.Message):
    __slots__ = ("replay_rows", "row_start", "row_end", "start_depth", "init_state", "exports")
    REPLAY_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    START_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INIT_STATE_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    replay_rows: bytes
    row_start: int
    row_end: int
    start_depth: int
    init_state: StateSource
    exports: _containers.RepeatedCompositeFieldContainer[StateExport]
    def __init__(self, replay_rows: _Optional[bytes] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., start_depth: _Optional[int] = ..., init_state: _Optional[_Union[StateSource, _Mapping]] = ..., exports: _Optional[_Iterable[_Union[StateExport, _Mapping]]] = ...) -> None: ...

class LinearCall(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[LinearSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[LinearSequence, _Mapping]]] = ...) -> None: ...

class StateImport(_message.Message):
    __slots__ = ("microbatch", "state")
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    microbatch: int
    state: int
    def __init__(self, microbatch: _Optional[int] = ..., state: _Optional[int] = ...) -> None: ...

class Microbatch(_message.Message):
    __slots__ = ("id", "num_rows", "tokens", "depth", "occurrence", "seg_start", "seg_length", "seg_parent", "seg_tree", "seg_forest", "seg_forest_offset", "seg_duplicated", "conv_ancestors", "attn_offsets", "attn_ranges", "linear_calls", "num_states", "import_microbatch", "import_row", "state_imports", "export_rows", "export_states", "lp_row", "lp_label", "lp_traj", "lp_pos", "lp_loss_mask", "lp_old_logprob", "lp_ref_logprob", "lp_advantage", "cost", "replay_tokens", "duplicated_tokens", "recompute")
    ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCE_FIELD_NUMBER: _ClassVar[int]
    SEG_START_FIELD_NUMBER: _ClassVar[int]
    SEG_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEG_PARENT_FIELD_NUMBER: _ClassVar[int]
    SEG_TREE_FIELD_NUMBER: _ClassVar[int]
    SEG_FOREST_FIELD_NUMBER: _ClassVar[int]
    SEG_FOREST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEG_DUPLICATED_FIELD_NUMBER: _ClassVar[int]
    CONV_ANCESTORS_FIELD_NUMBER: _ClassVar[int]
    ATTN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ATTN_RANGES_FIELD_NUMBER: _ClassVar[int]
    LINEAR_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATES_FIELD_NUMBER: _ClassVar[int]
    IMPORT_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    IMPORT_ROW_FIELD_NUMBER: _ClassVar[int]
    STATE_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_STATES_FIELD_NUMBER: _ClassVar[int]
    LP_ROW_FIELD_NUMBER: _ClassVar[int]
    LP_LABEL_FIELD_NUMBER: _ClassVar[int]
    LP_TRAJ_FIELD_NUMBER: _ClassVar[int]
    LP_POS_FIELD_NUMBER: _ClassVar[int]
    LP_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LP_OLD_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LP_REF_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LP_ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    id: int
    num_rows: int
    tokens: bytes
    depth: bytes
    occurrence: bytes
    seg_start: bytes
    seg_length: bytes
    seg_parent: bytes
    seg_tree: bytes
    seg_forest: bytes
    seg_forest_offset: bytes
    seg_duplicated: bytes
    conv_ancestors: bytes
    attn_offsets: bytes
    attn_ranges: bytes
    linear_calls: _containers.RepeatedCompositeFieldContainer[LinearCall]
    num_states: int
    import_microbatch: bytes
    import_row: bytes
    state_imports: _containers.RepeatedCompositeFieldContainer[StateImport]
    export_rows: bytes
    export_states: bytes
    lp_row: bytes
    lp_label: bytes
    lp_traj: bytes
    lp_pos: bytes
    lp_loss_mask: bytes
    lp_old_logprob: bytes
    lp_ref_logprob: bytes
    lp_advantage: bytes
    cost: float
    replay_tokens: int
    duplicated_tokens: int
    recompute: bool
    def __init__(self, id: _Optional[int] = ..., num_rows: _Optional[int] = ..., tokens: _Optional[bytes] = ..., depth: _Optional[bytes] = ..., occurrence: _Optional[bytes] = ..., seg_start: _Optional[bytes] = ..., seg_length: _Optional[bytes] = ..., seg_parent: _Optional[bytes] = ..., seg_tree: _Optional[bytes] = ..., seg_forest: _Optional[bytes] = ..., seg_forest_offset: _Optional[bytes] = ..., seg_duplicated: _Optional[bytes] = ..., conv_ancestors: _Optional[bytes] = ..., attn_offsets: _Optional[bytes] = ..., attn_ranges: _Optional[bytes] = ..., linear_calls: _Optional[_Iterable[_Union[LinearCall, _Mapping]]] = ..., num_states: _Optional[int] = ..., import_microbatch: _Optional[bytes] = ..., import_row: _Optional[bytes] = ..., state_imports: _Optional[_Iterable[_Union[StateImport, _Mapping]]] = ..., export_rows: _Optional[bytes] = ..., export_states: _Optional[bytes] = ..., lp_row: _Optional[bytes] = ..., lp_label: _Optional[bytes] = ..., lp_traj: _Optional[bytes] = ..., lp_pos: _Optional[bytes] = ..., lp_loss_mask: _Optional[bytes] = ..., lp_old_logprob: _Optional[bytes] = ..., lp_ref_logprob: _Optional[bytes] = ..., lp_advantage: _Optional[bytes] = ..., cost: _Optional[float] = ..., replay_tokens: _Optional[int] = ..., duplicated_tokens: _Optional[int] = ..., recompute: _Optional[bool] = ...) -> None: ...

class ExecStep(_message.Message):
    __slots__ = ("kind", "microbatch", "standin")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORWARD: _ClassVar[ExecStep.Kind]
        BACKWARD: _ClassVar[ExecStep.Kind]
    FORWARD: ExecStep.Kind
    BACKWARD: ExecStep.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    STANDIN_FIELD_NUMBER: _ClassVar[int]
    kind: ExecStep.Kind
    microbatch: int
    standin: int
    def __init__(self, kind: _Optional[_Union[ExecStep.Kind, str]] = ..., microbatch: _Optional[int] = ..., standin: _Optional[int] = ...) -> None: ...

class RankPlan(_message.Message):
    __slots__ = ("rank", "microbatches", "steps", "cross_edges")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CROSS_EDGES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    microbatches: _containers.RepeatedCompositeFieldContainer[Microbatch]
    steps: _containers.RepeatedCompositeFieldContainer[ExecStep]
    cross_edges: _containers.RepeatedCompositeFieldContainer[CrossEdge]
    def __init__(self, rank: _Optional[int] = ..., microbatches: _Optional[_Iterable[_Union[Microbatch, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[ExecStep, _Mapping]]] = ..., cross_edges: _Optional[_Iterable[_Union[CrossEdge, _Mapping]]] = ...) -> None: ...

class CrossEdge(_message.Message):
    __slots__ = ("id", "exporter", "exporter_rank", "importer", "importer_rank", "attn_rows", "conv_rows", "kernel_rows", "states", "send_phase", "grad_phase", "bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_RANK_FIELD_NUMBER: _ClassVar[int]
    IMPORTER_FIELD_NUMBER: _ClassVar[int]
    IMPORTER_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTN_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONV_ROWS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ROWS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    SEND_PHASE_FIELD_NUMBER: _ClassVar[int]
    GRAD_PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    exporter: int
    exporter_rank: int
    importer: int
    importer_rank: int
    attn_rows: bytes
    conv_rows: bytes
    kernel_rows: bytes
    states: bytes
    send_phase: int
    grad_phase: int
    bytes: int
    def __init__(self, id: _Optional[int] = ..., exporter: _Optional[int] = ..., exporter_rank: _Optional[int] = ..., importer: _Optional[int] = ..., importer_rank: _Optional[int] = ..., attn_rows: _Optional[bytes] = ..., conv_rows: _Optional[bytes] = ..., kernel_rows: _Optional[bytes] = ..., states: _Optional[bytes] = ..., send_phase: _Optional[int] = ..., grad_phase: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Normalizers(_message.Message):
    __slots__ = ("total_loss_tokens", "num_trajectories", "traj_loss_tokens", "traj_weight")
    TOTAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TRAJ_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAJ_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    total_loss_tokens: float
    num_trajectories: int
    traj_loss_tokens: bytes
    traj_weight: bytes
    def __init__(self, total_loss_tokens: _Optional[float] = ..., num_trajectories: _Optional[int] = ..., traj_loss_tokens: _Optional[bytes] = ..., traj_weight: _Optional[bytes] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("unique_tokens", "expanded_tokens", "computed_tokens", "replay_tokens", "duplicated_tokens", "compression_ideal", "compression_achieved", "microbatches", "linear_attention_calls", "rank_costs", "imbalance", "peak_live_tokens", "plan_seconds", "windows", "peak_live_bytes", "makespan_lower_bound", "makespan_ratio", "makespan", "lockstep_phases", "lockstep_makespan", "lockstep_ratio", "lockstep_forward_phases", "lockstep_backward_phases", "lockstep_recompute_phases", "cross_edges", "exchanged_bytes", "max_rank_exchanged_bytes", "rank_transfer_costs", "with_cross_edges", "without_cross_edges")
    UNIQUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_IDEAL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_ACHIEVED_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    LINEAR_ATTENTION_CALLS_FIELD_NUMBER: _ClassVar[int]
    RANK_COSTS_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    PEAK_LIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    PEAK_LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_PHASES_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_MAKESPAN_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_FORWARD_PHASES_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_BACKWARD_PHASES_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_RECOMPUTE_PHASES_FIELD_NUMBER: _ClassVar[int]
    CROSS_EDGES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_EXCHANGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_TRANSFER_COSTS_FIELD_NUMBER: _ClassVar[int]
    WITH_CROSS_EDGES_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_CROSS_EDGES_FIELD_NUMBER: _ClassVar[int]
    unique_tokens: int
    expanded_tokens: int
    computed_tokens: int
    replay_tokens: int
    duplicated_tokens: int
    compression_ideal: float
    compression_achieved: float
    microbatches: int
    linear_attention_calls: int
    rank_costs: _containers.RepeatedScalarFieldContainer[float]
    imbalance: float
    peak_live_tokens: int
    plan_seconds: float
    windows: int
    peak_live_bytes: int
    makespan_lower_bound: float
    makespan_ratio: float
    makespan: float
    lockstep_phases: int
    lockstep_makespan: float
    lockstep_ratio: float
    lockstep_forward_phases: int
    lockstep_backward_phases: int
    lockstep_recompute_phases: int
    cross_edges: int
    exchanged_bytes: int
    max_rank_exchanged_bytes: int
    rank_transfer_costs: _containers.RepeatedScalarFieldContainer[float]
    with_cross_edges: PlanCandidate
    without_cross_edges: PlanCandidate
    def __init__(self, unique_tokens: _Optional[int] = ..., expanded_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., duplicated_tokens: _Optional[int] = ..., compression_ideal: _Optional[float] = ..., compression_achieved: _Optional[float] = ..., microbatches: _Optional[int] = ..., linear_attention_calls: _Optional[int] = ..., rank_costs: _Optional[_Iterable[float]] = ..., imbalance: _Optional[float] = ..., peak_live_tokens: _Optional[int] = ..., plan_seconds: _Optional[float] = ..., windows: _Optional[int] = ..., peak_live_bytes: _Optional[int] = ..., makespan_lower_bound: _Optional[float] = ..., makespan_ratio: _Optional[float] = ..., makespan: _Optional[float] = ..., lockstep_phases: _Optional[int] = ..., lockstep_makespan: _Optional[float] = ..., lockstep_ratio: _Optional[float] = ..., lockstep_forward_phases: _Optional[int] = ..., lockstep_backward_phases: _Optional[int] = ..., lockstep_recompute_phases: _Optional[int] = ..., cross_edges: _Optional[int] = ..., exchanged_bytes: _Optional[int] = ..., max_rank_exchanged_bytes: _Optional[int] = ..., rank_transfer_costs: _Optional[_Iterable[float]] = ..., with_cross_edges: _Optional[_Union[PlanCandidate, _Mapping]] = ..., without_cross_edges: _Optional[_Union[PlanCandidate, _Mapping]] = ...) -> None: ...

class PlanCandidate(_message.Message):
    __slots__ = ("compression_achieved", "makespan_ratio", "lockstep_makespan", "duplicated_tokens", "cross_edges", "exchanged_bytes", "makespan", "makespan_lower_bound")
    COMPRESSION_ACHIEVED_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_MAKESPAN_FIELD_NUMBER: _ClassVar[int]
    DUPLICATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CROSS_EDGES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    compression_achieved: float
    makespan_ratio: float
    lockstep_makespan: float
    duplicated_tokens: int
    cross_edges: int
    exchanged_bytes: int
    makespan: float
    makespan_lower_bound: float
    def __init__(self, compression_achieved: _Optional[float] = ..., makespan_ratio: _Optional[float] = ..., lockstep_makespan: _Optional[float] = ..., duplicated_tokens: _Optional[int] = ..., cross_edges: _Optional[int] = ..., exchanged_bytes: _Optional[int] = ..., makespan: _Optional[float] = ..., makespan_lower_bound: _Optional[float] = ...) -> None: ...

class PlanHeader(_message.Message):
    __slots__ = ("version", "step_id", "params", "normalizers", "stats", "trajectory_ids", "trajectory_lengths", "tree_ids", "trajectory_index", "tree_index", "local_tables", "policy_version", "trajectory_rewards", "lockstep_phases")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZERS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TREE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_INDEX_FIELD_NUMBER: _ClassVar[int]
    TREE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TABLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_REWARDS_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_PHASES_FIELD_NUMBER: _ClassVar[int]
    version: str
    step_id: str
    params: PlanParams
    normalizers: Normalizers
    stats: PlanStats
    trajectory_ids: _containers.RepeatedScalarFieldContainer[str]
    trajectory_lengths: bytes
    tree_ids: _containers.RepeatedScalarFieldContainer[str]
    trajectory_index: bytes
    tree_index: bytes
    local_tables: bool
    policy_version: int
    trajectory_rewards: bytes
    lockstep_phases: bytes
    def __init__(self, version: _Optional[str] = ..., step_id: _Optional[str] = ..., params: _Optional[_Union[PlanParams, _Mapping]] = ..., normalizers: _Optional[_Union[Normalizers, _Mapping]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., trajectory_ids: _Optional[_Iterable[str]] = ..., trajectory_lengths: _Optional[bytes] = ..., tree_ids: _Optional[_Iterable[str]] = ..., trajectory_index: _Optional[bytes] = ..., tree_index: _Optional[bytes] = ..., local_tables: _Optional[bool] = ..., policy_version: _Optional[int] = ..., trajectory_rewards: _Optional[bytes] = ..., lockstep_phases: _Optional[bytes] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("header", "ranks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    header: PlanHeader
    ranks: _containers.RepeatedCompositeFieldContainer[RankPlan]
    def __init__(self, header: _Optional[_Union[PlanHeader, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankPlan, _Mapping]]] = ...) -> None: ...

class PlanSlice(_message.Message):
    __slots__ = ("header", "rank", "checksum")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    header: PlanHeader
    rank: RankPlan
    checksum: str
    def __init__(self, header: _Optional[_Union[PlanHeader, _Mapping]] = ..., rank: _Optional[_Union[RankPlan, _Mapping]] = ..., checksum: _Optional[str] = ...) -> None: ...
