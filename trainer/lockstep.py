"""Lock-step execution on a rank: the stand-in microbatch.

    mb = standin_microbatch(conv_kernel=4)   # one row (token 0, occurrence 0), no log-prob entries: loss exactly 0

The phase rules are `plan.phases`, checked with the slice by `plan.slice_check`; what a stand-in
step runs in each phase (`trainer.step_walk`) and why every rank must issue the same FSDP2
collectives: docs/design/lockstep.md ("Phases and stand-ins"). A rank of a free plan without
microbatches runs the same microbatch once (`trainer.parallelize.participation_slice`).
"""
from __future__ import annotations

from proto.arrays import pack
from proto.harts.v1 import plan_pb2

__all__ = ["standin_microbatch"]


def standin_microbatch(*, conv_kernel: int) -> plan_pb2.Microbatch:
    """The one-row stand-in: token 0 at depth 0, occurrence 0, a duplicated segment, one linear
    sequence from a zero state and no log-prob entries, so its loss and gradients are exact zeros."""
    one = lambda v: pack([v], "int32")  # noqa: E731
    mb = plan_pb2.Microbatch(
        id=-1, num_rows=1, tokens=one(0), depth=one(0), occurrence=one(0), seg_start=one(0), seg_length=one(1),
        seg_parent=one(-1), seg_tree=one(0), seg_forest=one(0), seg_forest_offset=one(0),
        seg_duplicated=pack([1], "uint8"), conv_ancestors=pack([-1] * max(conv_kernel - 1, 0), "int32"),
        attn_offsets=pack([0, 0], "int32"), num_states=0,
    )
    seq = mb.linear_calls.add().sequences.add(row_start=0, row_end=1, start_depth=0)
    seq.init_state.kind = plan_pb2.StateSource.ZERO
    return mb
