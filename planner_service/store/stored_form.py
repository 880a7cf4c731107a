"""How bodies and sealed plan slices are kept in the database: compressed, restored byte for byte.

    stored = pack_slice(sealed)       # MAGIC_DELTA: 32-bit differences of the byte columns, then zlib
    stored = pack_body(body)          # MAGIC_ZLIB: zlib of the bytes received
    sealed = unpack(stored)           # exactly the sealed bytes (a value of an earlier version as it is)

`pack_slice` checks the round trip before it trusts the transform and otherwise keeps plain zlib
(docs/design/service.md, "Storage").
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
