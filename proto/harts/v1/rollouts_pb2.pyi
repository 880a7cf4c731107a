from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("id", "tree_id", "tokens", "loss_mask", "old_logprobs", "ref_logprobs", "advantages", "advantage", "reward", "group_id", "weight")
    ID_FIELD_NUMBER: _ClassVar[int]
    TREE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tree_id: str
    tokens: bytes
    loss_mask: bytes
    old_logprobs: bytes
    ref_logprobs: bytes
    advantages: bytes
    advantage: float
    reward: float
    group_id: str
    weight: float
    def __init__(self, id: _Optional[str] = ..., tree_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., old_logprobs: _Optional[bytes] = ..., ref_logprobs: _Optional[bytes] = ..., advantages: _Optional[bytes] = ..., advantage: _Optional[float] = ..., reward: _Optional[float] = ..., group_id: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("id", "parent", "tokens", "loss_mask", "old_logprobs", "ref_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    parent: int
    tokens: bytes
    loss_mask: bytes
    old_logprobs: bytes
    ref_logprobs: bytes
    def __init__(self, id: _Optional[int] = ..., parent: _Optional[int] = ..., tokens: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., old_logprobs: _Optional[bytes] = ..., ref_logprobs: _Optional[bytes] = ...) -> None: ...

class TreeTrajectory(_message.Message):
    __slots__ = ("id", "node", "loss_mask", "old_logprobs", "ref_logprobs", "advantages", "advantage", "reward", "group_id", "weight")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    id: str
    node: int
    loss_mask: bytes
    old_logprobs: bytes
    ref_logprobs: bytes
    advantages: bytes
    advantage: float
    reward: float
    group_id: str
    weight: float
    def __init__(self, id: _Optional[str] = ..., node: _Optional[int] = ..., loss_mask: _Optional[bytes] = ..., old_logprobs: _Optional[bytes] = ..., ref_logprobs: _Optional[bytes] = ..., advantages: _Optional[bytes] = ..., advantage: _Optional[float] = ..., reward: _Optional[float] = ..., group_id: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class RolloutTree(_message.Message):
    __slots__ = ("id", "nodes", "trajectories")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    nodes: _containers.RepeatedCompositeFieldContainer[TreeNode]
    trajectories: _containers.RepeatedCompositeFieldContainer[TreeTrajectory]
    def __init__(self, id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., trajectories: _Optional[_Iterable[_Union[TreeTrajectory, _Mapping]]] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("batch_id", "vocab_size", "trajectories", "trees", "policy_version")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    vocab_size: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    trees: _containers.RepeatedCompositeFieldContainer[RolloutTree]
    policy_version: int
    def __init__(self, batch_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., trees: _Optional[_Iterable[_Union[RolloutTree, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...
