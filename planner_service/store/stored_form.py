"""How bodies and sealed plan slices are kept in the database: compressed, restored byte for byte.

A sealed slice is mostly little-endian integer columns (DESIGN §4.4): row indices, depths,
window imports and exports, log-prob rows and positions, most of them runs that grow by one. Kept
as they are, the slices of a 12 x 100k-token batch planned for 8 ranks are ~58x the submitted
JSON; zlib alone gets that to ~14x. `pack_slice` first replaces every bytes column whose length
is a multiple of 4 by its differences (unsigned 32-bit lanes, wrapping: exactly invertible for
any bytes, whatever the column's type), then compresses the message with zlib: ~1.8x the JSON.
`unpack` adds the differences back up and re-serialises deterministically, which gives the sealed
bytes exactly (seal() serialises deterministically too); `pack_slice` checks that before it
trusts the transform and otherwise keeps plain zlib of the sealed bytes. Bodies are kept as zlib
of the bytes received.

Stored form: `MAGIC_DELTA` or `MAGIC_ZLIB` + zlib data. Anything else is a value stored verbatim
by an earlier version (a sealed slice starts with protobuf tag 0x0a, a body with JSON text or a
tag byte, never with 0xff), returned as it is.
"""
from __future__ import annotations

import zlib

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from proto.harts.v1 import plan_pb2

__all__ = ["pack_slice", "pack_body", "unpack", "MAGIC_DELTA", "MAGIC_ZLIB"]

MAGIC_DELTA = b"\xffHD1"
"""A PlanSlice whose integer columns hold differences, then zlib."""
MAGIC_ZLIB = b"\xffHZ1"
"""zlib of the bytes as received or sealed."""

_LEVEL = 1
"""zlib level: 6 saves ~9% more on slices at 6x the time; planning must not wait on it."""


def _columns(msg, fn) -> None:
    """Apply `fn` to every (non-repeated) bytes field of `msg` and its sub-messages, in place."""
    for field, value in msg.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in (value if field.is_repeated else (value,)):
                _columns(item, fn)
        elif field.type == FieldDescriptor.TYPE_BYTES and not field.is_repeated:
            out = fn(value)
            if out is not value:
                setattr(msg, field.name, out)


def _diff(data: bytes) -> bytes:
    if len(data) < 8 or len(data) % 4:
        return data
    x = np.frombuffer(data, "<u4")
    d = np.empty_like(x)
    d[0] = x[0]
    np.subtract(x[1:], x[:-1], out=d[1:])
    return d.tobytes()


def _undiff(data: bytes) -> bytes:
    if len(data) < 8 or len(data) % 4:
        return data
    return np.cumsum(np.frombuffer(data, "<u4"), dtype=np.uint32).astype("<u4", copy=False).tobytes()


def _restore_slice(packed: bytes) -> bytes:
    msg = plan_pb2.PlanSlice.FromString(zlib.decompress(packed))
    _columns(msg, _undiff)
    return msg.SerializeToString(deterministic=True)


def pack_slice(sealed: bytes) -> bytes:
    """Stored form of sealed PlanSlice bytes (`unpack` gives them back exactly)."""
    msg = plan_pb2.PlanSlice.FromString(sealed)
    _columns(msg, _diff)
    packed = zlib.compress(msg.SerializeToString(deterministic=True), _LEVEL)
    if _restore_slice(packed) == sealed:
        return MAGIC_DELTA + packed
    return MAGIC_ZLIB + zlib.compress(sealed, _LEVEL)


def pack_body(body: bytes | bytearray) -> bytes:
    """Stored form of a submitted body."""
    return MAGIC_ZLIB + zlib.compress(body, _LEVEL)


def unpack(stored: bytes | memoryview) -> bytes:
    """The bytes a stored value stands for (a value of an earlier version: itself)."""
    stored = bytes(stored)
    head = stored[:4]
    if head == MAGIC_DELTA:
        return _restore_slice(stored[4:])
    if head == MAGIC_ZLIB:
        return zlib.decompress(stored[4:])
    return stored
