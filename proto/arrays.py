"""Little-endian array codecs for the `bytes` fields of the wire contract.

Every large array of a HARTS message is a little-endian `bytes` field; these two functions are
the only place that converts between them and numpy (docs/design/plan-contract.md, "Conventions").
"""
from __future__ import annotations

import numpy as np

#: dtypes the contract uses, by their short names in proto comments.
DTYPES = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "float32": np.dtype("<f4"),
}


def pack(values, dtype: str) -> bytes:
    """Encode `values` (array-like) as little-endian `dtype` bytes.

    Args:
        values: anything numpy can convert; converted (not reinterpreted) to `dtype`.
        dtype: one of DTYPES' keys.
    """
    return np.ascontiguousarray(np.asarray(values), dtype=DTYPES[dtype]).tobytes()


def unpack(data: bytes, dtype: str, *, width: int = 1, name: str = "array") -> np.ndarray:
    """Decode little-endian `dtype` bytes into a read-only native-endian array.

    Args:
        data: the field's bytes.
        dtype: one of DTYPES' keys.
        width: row width; the result has shape [n, width] when width > 1, else [n].
        name: field name for the error message.

    Raises:
        ValueError: the byte length is not a multiple of the item size times `width`.
    """
    dt = DTYPES[dtype]
    if len(data) % (dt.itemsize * width):
        raise ValueError(
            f"{name}: expected a multiple of {dt.itemsize * width} bytes ({dtype} x {width}), "
            f"got {len(data)}"
        )
    arr = np.frombuffer(data, dtype=dt)
    if dt.byteorder == "<" and np.little_endian is False:  # pragma: no cover - big-endian hosts
        arr = arr.astype(dt.newbyteorder("="))
    return arr.reshape(-1, width) if width > 1 else arr
