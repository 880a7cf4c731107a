"""Name the field of protobuf bytes that do not parse (HTTP protobuf bodies and gRPC requests).

protobuf only says "Error parsing message" for bytes it refuses, most often a string field that
is not UTF-8 (an id a generator built from raw bytes). `wire_error` walks the wire format with the
message's descriptor and names the first string field whose bytes are not UTF-8, as the JSON path
does ("trajectories[2].id: expected UTF-8 text, ..."); other damage gets the generic message.
`field_bytes` cuts a message field's bytes out of its parent as they arrived (gRPC stores and
digests the submitted batch exactly as the client serialised it; docs/design/service.md).
"""
from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from planner_service.errors import ValidationError

__all__ = ["wire_error", "invalid_utf8_field", "field_bytes"]

_MAX_DEPTH = 32


class _Damaged(Exception):
    """The bytes are not a well-formed wire encoding (the generic message applies)."""


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise _Damaged
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _walk(desc: Descriptor, data: memoryview, path: str, depth: int) -> tuple[str, str] | None:
    """(field path, problem) of the first string that is not UTF-8, or None."""
    if depth > _MAX_DEPTH:
        raise _Damaged
    counts: dict[int, int] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
            continue
        if wire == 1 or wire == 5:
            i += 8 if wire == 1 else 4
            if i > len(data):
                raise _Damaged
            continue
        if wire != 2:
            raise _Damaged
        size, i = _varint(data, i)
        if i + size > len(data):
            raise _Damaged
        value, i = data[i:i + size], i + size
        field = desc.fields_by_number.get(number)
        if field is None:
            continue
        k = counts[number] = counts.get(number, -1) + 1
        name = f"{path}{field.name}" + (f"[{k}]" if field.is_repeated else "")
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                str(value, "utf-8")
            except UnicodeDecodeError as exc:
                return name, f"expected UTF-8 text, got bytes that are not UTF-8 (byte {exc.start}: {bytes(value[exc.start:exc.start + 1])!r})"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _walk(field.message_type, value, name + ".", depth + 1)
            if found is not None:
                return found
    return None


def invalid_utf8_field(desc: Descriptor, data: bytes | bytearray | memoryview, prefix: str = "") -> tuple[str, str] | None:
    """(field path, problem) of the first string field of `data` (a serialised `desc` message)
    that is not UTF-8; None when there is none or the bytes are damaged otherwise."""
    try:
        return _walk(desc, memoryview(data).cast("B"), prefix, 0)
    except _Damaged:
        return None


def wire_error(message_cls, data: bytes | bytearray | memoryview, field: str, prefix: str = "") -> ValidationError:
    """The ValidationError for `data` that `message_cls` cannot parse: the string field that is
    not UTF-8 when there is one, else `field` with the generic message."""
    found = invalid_utf8_field(message_cls.DESCRIPTOR, data, prefix)
    if found is not None:
        return ValidationError(*found)
    return ValidationError(field, f"expected a serialised {message_cls.DESCRIPTOR.full_name}, got bytes that do not parse")


def field_bytes(data: bytes | bytearray | memoryview, number: int) -> bytes | None:
    """The bytes of the length-delimited top-level field `number` of a serialised message, its
    occurrences concatenated (what protobuf merges into one message), b"" when absent; None when
    the bytes are damaged or hold a wire type this walk does not follow (a group)."""
    view = memoryview(data).cast("B")
    parts = []
    i = 0
    try:
        while i < len(view):
            key, i = _varint(view, i)
            wire = key & 7
            if wire == 0:
                _, i = _varint(view, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                size, i = _varint(view, i)
                if key >> 3 == number:
                    parts.append(view[i:i + size])
                i += size
            else:
                return None
            if i > len(view):
                return None
    except _Damaged:
        return None
    return b"".join(parts)
