"""The wire contract: generated modules are fresh, array codecs round-trip, sealed slices verify."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from proto import arrays
from plan import seal as plan_io
from proto.generate import REPO, generate
from proto.harts.v1 import plan_pb2


def test_generated_modules_are_fresh(tmp_path: pathlib.Path):
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = REPO / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} is stale: run `make proto`"


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "float32"])
def test_arrays_round_trip(dtype):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 200, size=37)
    data = arrays.pack(values, dtype)
    assert len(data) == 37 * arrays.DTYPES[dtype].itemsize
    np.testing.assert_array_equal(arrays.unpack(data, dtype), values.astype(arrays.DTYPES[dtype]))


def test_arrays_width_and_bad_length():
    data = arrays.pack(np.arange(6), "int32")
    assert arrays.unpack(data, "int32", width=3).shape == (2, 3)
    with pytest.raises(ValueError, match="conv_ancestors: expected a multiple of 16 bytes"):
        arrays.unpack(data, "int32", width=4, name="conv_ancestors")


def _plan() -> plan_pb2.Plan:
    plan = plan_pb2.Plan()
    plan.header.version = plan_io.PLAN_VERSION
    plan.header.step_id = "step-0"
    for r in range(2):
        rank = plan.ranks.add(rank=r)
        mb = rank.microbatches.add(id=r, num_rows=3)
        mb.tokens = arrays.pack([1, 2, 3 + r], "int32")
    return plan


def test_sealed_slice_round_trip_and_tamper():
    data = plan_io.seal(plan_io.slice_plan(_plan(), 1))
    assert data == plan_io.seal(plan_io.slice_plan(_plan(), 1)), "sealing must be deterministic"
    got = plan_io.open_sealed(data)
    assert got.rank.rank == 1 and got.header.step_id == "step-0"
    tampered = plan_pb2.PlanSlice.FromString(data)
    tampered.rank.microbatches[0].tokens = arrays.pack([1, 2, 5], "int32")
    with pytest.raises(plan_io.ChecksumError, match="checksum mismatch"):
        plan_io.open_sealed(tampered.SerializeToString(deterministic=True))
    with pytest.raises(plan_io.ChecksumError):
        plan_io.open_sealed(data[:-7])
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < 2, got 2"):
        plan_io.slice_plan(_plan(), 2)
