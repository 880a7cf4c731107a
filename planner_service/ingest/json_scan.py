"""Numba pre-pass over JSON rollout text: the per-position number arrays straight into numpy.

    scan = scan_json(body_bytes, max_depth=32)    # ScannedJSON: skeleton bytes + one typed buffer per field

Every flat list of JSON numbers under `tokens`, `loss_mask`, `old_logprobs`, `ref_logprobs` or
`advantage` is parsed into its field's buffer (`json_numbers.py`) and replaced in the skeleton by
the placeholder `"\\u0000<k>"`; the pass never decides validity, and a text holding `\\u0000`
keeps every list (docs/design/rollout-forest.md, "Reading JSON without decoding its numbers").
Legend: n body bytes, A lists found, E elements of one field's lists, X elements converted by float().
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from planner_service.ingest.json_numbers import POW10, fix_floats, grow, overlapping_words, parse_all

#: Member names whose number lists are parsed, in buffer order (FIELD index = position).
FIELDS = ("tokens", "loss_mask", "old_logprobs", "ref_logprobs", "advantage")
TOKENS, MASK = 0, 1
_FLOAT_FIELDS = (2, 3, 4)
#: Placeholder prefix of a parsed list in the skeleton (decoded form).
PLACEHOLDER = "\x00"

#: Byte classes inside a candidate list: bit 0 = cannot occur in a flat number list, bit 1 = number text.
_CLS = np.ones(256, np.uint8)
for _c in b" \t\n\r,]":
    _CLS[_c] = 0
for _c in b"0123456789+-.eEaINnfity":  # number literals, and the letters of NaN / Infinity
    _CLS[_c] = 2

_KEYS = np.frombuffer(b"".join(f.encode() for f in FIELDS), np.uint8).copy()
_KEY_OFF = np.cumsum([0] + [len(f) for f in FIELDS]).astype(np.int64)

_OBJ, _ARR = 1, 2


@njit(cache=True)
def _key_field(buf, a, b, keys, key_off):
    """Index in FIELDS of the key buf[a:b], or -1."""
    for f in range(key_off.shape[0] - 1):
        ka, kb = key_off[f], key_off[f + 1]
        if kb - ka != b - a:
            continue
        same = True
        for i in range(kb - ka):
            if buf[a + i] != keys[ka + i]:
                same = False
                break
        if same:
            return f
    return -1


@njit(cache=True)
def _string_end(buf, i, n):
    """The closing quote of the string opening at buf[i] (n when unterminated), and whether the
    string holds the escape \\u0000 (a user string could then spell a placeholder)."""
    nul = False
    j = i + 1
    while j < n:
        d = buf[j]
        if d == 92:
            if (j + 5 < n and buf[j + 1] == 117 and buf[j + 2] == 48 and buf[j + 3] == 48
                    and buf[j + 4] == 48 and buf[j + 5] == 48):
                nul = True
            j += 2
            continue
        if d == 34:
            break
        j += 1
    return j, nul


@njit(cache=True)
def _flat_list_end(buf, cls, i, n):
    """The ']' of the list opening at buf[i] when it is a flat list of number text, else -1; and
    its comma count. Branch-free over the bulk of the text: stops at ']' or at a byte no flat
    number list has."""
    k = i + 1
    commas = 0
    acc = 0
    while k < n:
        d = buf[k]
        if d == 93:
            break
        commas += d == 44
        acc |= cls[d]
        if acc & 1:
            break
        k += 1
    if k < n and acc == 2:
        return k, commas
    return -1, commas


@njit(cache=True)
def _literal_end(buf, i, n):
    """The end of the scalar literal (number, true, false, null, NaN, Infinity) or invalid text at
    buf[i], and whether it holds a run of 19 or more digits (an integer that may not fit int64)."""
    run = 0
    long_int = False
    while i < n:
        d = buf[i]
        if d == 32 or d == 10 or d == 13 or d == 9 or d == 44 or d == 58 or d == 93 or d == 125 or d == 91 \
                or d == 123 or d == 34:
            break
        if 48 <= d <= 57:
            run += 1
            if run >= 19:
                long_int = True
        else:
            run = 0
        i += 1
    return i, long_int


@njit(cache=True)
def _add_candidate(c_field, c_start, c_end, c_count, A, field, start, end, count):
    """Append candidate A (growing the buffers); returns the buffers."""
    c_field = grow(c_field, A)
    c_start = grow(c_start, A)
    c_end = grow(c_end, A)
    c_count = grow(c_count, A)
    c_field[A] = field
    c_start[A] = start
    c_end[A] = end
    c_count[A] = count
    return c_field, c_start, c_end, c_count


@njit(cache=True)
def _structure(buf, cls, keys, key_off, max_depth):
    """Find the candidate lists; track nesting.

    Returns (field [A] int8, start [A], end [A], count [A], has_nul_escape, long_int, error_at,
    path_kind, path_key_a, path_key_b, path_index): a candidate spans buf[start:end] ('[' to ']'
    inclusive) with `count` comma-separated elements. error_at >= 0 is the offset of the first
    container deeper than max_depth; path_* describe the enclosing containers 1..max_depth then.
    """
    n = buf.shape[0]
    D = max_depth + 2
    # the enclosing containers, 1..depth: kind, current member's FIELDS index and key span,
    # element index (arrays), whether the next string is a key (objects)
    kind = np.zeros(D, np.int8)
    keyf = np.full(D, -1, np.int64)
    key_a = np.zeros(D, np.int64)
    key_b = np.zeros(D, np.int64)
    index = np.zeros(D, np.int64)
    expect_key = np.zeros(D, np.bool_)
    c_field = np.empty(64, np.int8)
    c_start = np.empty(64, np.int64)
    c_end = np.empty(64, np.int64)
    c_count = np.empty(64, np.int64)
    A = 0
    depth = 0
    after_colon = False
    nul = False
    long_int = False
    error_at = -1
    i = 0
    while i < n:
        c = buf[i]
        if c == 32 or c == 10 or c == 13 or c == 9:
            i += 1
        elif c == 34:  # string
            j, has_nul = _string_end(buf, i, n)
            nul |= has_nul
            if depth >= 1 and kind[depth] == _OBJ and expect_key[depth]:
                expect_key[depth] = False
                keyf[depth] = _key_field(buf, i + 1, min(j, n), keys, key_off)
                key_a[depth] = i + 1
                key_b[depth] = min(j, n)
            after_colon = False
            i = j + 1
        elif c == 91 or c == 123:  # '[' '{'
            if c == 91 and after_colon and depth >= 1 and kind[depth] == _OBJ and keyf[depth] >= 0:
                k, commas = _flat_list_end(buf, cls, i, n)
                if k >= 0:
                    c_field, c_start, c_end, c_count = _add_candidate(c_field, c_start, c_end, c_count, A,
                                                                      keyf[depth], i, k + 1, commas + 1)
                    A += 1
                    after_colon = False
                    i = k + 1
                    continue
            depth += 1
            if depth > max_depth:
                error_at = i
                break
            kind[depth] = _ARR if c == 91 else _OBJ
            index[depth] = 0
            expect_key[depth] = c == 123
            keyf[depth] = -1
            after_colon = False
            i += 1
        elif c == 93 or c == 125:  # ']' '}'
            if depth > 0:
                depth -= 1
            after_colon = False
            i += 1
        elif c == 44:  # ','
            if depth >= 1:
                if kind[depth] == _ARR:
                    index[depth] += 1
                else:
                    expect_key[depth] = True
                    keyf[depth] = -1
            after_colon = False
            i += 1
        elif c == 58:  # ':'
            after_colon = True
            i += 1
        else:
            i, long_run = _literal_end(buf, i, n)
            long_int |= long_run
            after_colon = False
    return (c_field[:A], c_start[:A], c_end[:A], c_count[:A], nul, long_int, error_at,
            kind[1 : max_depth + 1].copy(), key_a[1 : max_depth + 1].copy(), key_b[1 : max_depth + 1].copy(),
            index[1 : max_depth + 1].copy())


@njit(cache=True)
def _skeleton(buf, starts, ends):
    """buf with list k (buf[starts[k]:ends[k]], ascending, disjoint) replaced by the JSON string "\\u0000k"."""
    n = buf.shape[0]
    A = starts.shape[0]
    size = n
    for k in range(A):
        nd = 1
        v = k
        while v >= 10:
            v //= 10
            nd += 1
        size += 8 + nd - (ends[k] - starts[k])
    out = np.empty(size, np.uint8)
    w = 0
    prev = 0
    for k in range(A + 1):
        a = starts[k] if k < A else n
        for i in range(prev, a):
            out[w] = buf[i]
            w += 1
        if k == A:
            break
        for ch in (34, 92, 117, 48, 48, 48, 48):  # "\u0000
            out[w] = ch
            w += 1
        nd = 1
        v = k
        while v >= 10:
            v //= 10
            nd += 1
        v = k
        for j in range(nd - 1, -1, -1):
            out[w + j] = 48 + v % 10
            v //= 10
        w += nd
        out[w] = 34
        w += 1
        prev = ends[k]
    return out


@dataclass(slots=True)
class DepthError:
    """Where the text first nests deeper than the limit."""

    offset: int
    """Byte offset of the first container too deep."""
    path: list[str | int]
    """Member names (str) and list indices (int) of the enclosing containers, outermost first."""


@dataclass(slots=True, kw_only=True)
class ScannedJSON:
    """Result of `scan_json`."""

    skeleton: bytes
    """The text with every parsed list replaced by its placeholder string."""
    buffers: tuple[np.ndarray, ...]
    """Per FIELDS entry: the parsed elements (int32 tokens, uint8 masks, float32 otherwise)."""
    ref_field: np.ndarray
    """int64 [A'] FIELDS index of placeholder k's list."""
    ref_offset: np.ndarray
    """int64 [A'] its first element in buffers[ref_field[k]]."""
    ref_length: np.ndarray
    """int64 [A'] its elements."""
    ref_span: np.ndarray
    """int64 [A', 2] its byte span in the text (start, end)."""
    long_int: bool
    """The skeleton may hold an integer literal of >= 19 digits (decoders differ beyond 64 bits):
    one outside the lists, or a list that stayed in the skeleton."""
    depth_error: DepthError | None = None

    def placeholder(self, value: str) -> int | None:
        """k when `value` is the placeholder string of list k, else None. Lists are replaced only
        in a text without the escape \\u0000, the one way JSON spells the placeholder's first
        character, so a user's string (`"tokens": "\\u00000"`) is never taken for one."""
        digits = value[1:]
        if value[:1] != PLACEHOLDER or not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
            return None
        k = int(digits)
        return k if k < self.ref_length.shape[0] else None

    def values(self, k: int) -> np.ndarray:
        """The elements of placeholder k's list (a view)."""
        a = int(self.ref_offset[k])
        return self.buffers[int(self.ref_field[k])][a : a + int(self.ref_length[k])]

    def body_offset(self, skeleton_offset: int) -> int:
        """Byte offset in the text of a byte offset in the skeleton (a placeholder maps to its list)."""
        starts = self.ref_span[:, 0]
        ph = 9 + np.floor(np.log10(np.maximum(np.arange(starts.shape[0]), 1))).astype(np.int64)
        shift = np.cumsum(self.ref_span[:, 1] - starts - ph)  # bytes removed up to and including list k
        sk_start = starts - np.concatenate([[0], shift[:-1]]) if starts.shape[0] else starts
        k = int(np.searchsorted(sk_start, skeleton_offset, side="right")) - 1
        if k < 0:
            return skeleton_offset
        if skeleton_offset < sk_start[k] + ph[k]:
            return int(starts[k])
        return int(skeleton_offset + shift[k])


def scan_json(data: bytes | bytearray | memoryview, max_depth: int) -> ScannedJSON:
    """Parse the number lists of JSON text into typed buffers; the rest stays as the skeleton.

    A list the buffers cannot hold exactly (an element that is not a JSON number literal, an
    integer outside the buffer's type, a float that is not a finite float32, malformed number text)
    stays in the skeleton as it was, so the decoder and the checks see it unchanged; a text that
    holds the escape \\u0000 has no list replaced (docs/design/rollout-forest.md).

    Args:
        data: UTF-8 JSON text.
        max_depth: containers nested deeper stop the scan (`depth_error`).
    """
    buf = np.frombuffer(data, np.uint8)
    (c_field, c_start, c_end, c_count, nul, long_int, error_at,
     kind, key_a, key_b, index) = _structure(buf, _CLS, _KEYS, _KEY_OFF, max_depth)
    z = np.zeros(0, np.int64)
    if error_at >= 0:
        path: list[str | int] = []
        for d in range(max_depth):
            if kind[d] == _ARR:
                path.append(int(index[d]))
            elif kind[d] == _OBJ:
                path.append(bytes(data[key_a[d] : key_b[d]]).decode("utf-8", "replace"))
        return ScannedJSON(skeleton=b"", buffers=(), ref_field=z, ref_offset=z, ref_length=z,
                           ref_span=np.zeros((0, 2), np.int64), long_int=long_int,
                           depth_error=DepthError(offset=int(error_at), path=path))
    if nul:
        c_field, c_start, c_end, c_count = c_field[:0], c_start[:0], c_end[:0], c_count[:0]
    per_field = np.bincount(c_field.astype(np.int64), weights=c_count, minlength=len(FIELDS)).astype(np.int64)
    tok = np.empty(per_field[TOKENS], np.int32)
    mask = np.empty(per_field[MASK], np.uint8)
    flt_base = np.zeros(len(FIELDS), np.int64)
    total = 0
    for f in _FLOAT_FIELDS:
        flt_base[f] = total
        total += per_field[f]
    flt = np.empty(total, np.float32)
    offset, used, fix_pos, fix_a, fix_b, fix_list = parse_all(
        buf, overlapping_words(data), c_field, c_start, c_end, c_count, tok, mask, flt, flt_base, POW10)
    if fix_pos.shape[0]:
        fix_floats(data, flt, offset, fix_pos, fix_a, fix_b, fix_list)
    keep = np.flatnonzero(offset >= 0)
    field = c_field[keep].astype(np.int64)
    off = offset[keep]  # relative to the field's region (the float fields share one allocation)
    buffers = (tok, mask) + tuple(flt[flt_base[f] : flt_base[f] + per_field[f]] for f in _FLOAT_FIELDS)
    starts, ends = c_start[keep], c_end[keep]
    return ScannedJSON(
        skeleton=_skeleton(buf, starts, ends).tobytes(),
        buffers=buffers, ref_field=field, ref_offset=off, ref_length=c_count[keep],
        ref_span=np.stack([starts, ends], 1) if keep.shape[0] else np.zeros((0, 2), np.int64),
        long_int=bool(long_int) or keep.shape[0] < offset.shape[0],
    )


def warmup() -> None:
    """Compile (or load from the Numba cache) the scan on a tiny document."""
    scan_json(b'{"tokens": [1, 2], "loss_mask": [0, 1], "advantage": [0.5, 1e-40]}', 8)