"""Numba parsers of JSON number lists into typed buffers: the number half of `json_scan`.

    offset, used, fix_pos, fix_a, fix_b, fix_list = parse_all(buf, overlapping_words(data), c_field, c_start, c_end,
                                                              c_count, tok, mask, flt, flt_base, POW10)
    fix_floats(data, flt, offset, fix_pos, fix_a, fix_b, fix_list)

Integers exactly, floats as Python's `float()` would give them (Clinger's fast path, the rare
rest by `float()` in `fix_floats`): docs/design/rollout-forest.md, "Reading JSON without
decoding its numbers". Legend: n body bytes, A lists, X elements converted by float().
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

POW10 = np.array([float(f"1e{k}") for k in range(309)], np.float64)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


@njit(cache=True)
def grow(a, n):
    """`a`, or a copy of it with room for index n (twice as long plus 16)."""
    if n < a.shape[0]:
        return a
    out = np.empty(2 * a.shape[0] + 16, a.dtype)
    out[: a.shape[0]] = a
    return out


@njit(cache=True)
def _skip_ws(buf, p, end):
    while p < end:
        c = buf[p]
        if c == 32 or c == 10 or c == 13 or c == 9:
            p += 1
        else:
            break
    return p


_U = np.uint64
_ASCII0 = _U(0x3030303030303030)
_NONDIGIT_ADD = _U(0x7676767676767676)
_HIGH_BITS = _U(0x8080808080808080)
_PAIR_MASK = _U(0x000000FF000000FF)
_MUL1 = _U(100 + (1000000 << 32))
_MUL2 = _U(1 + (10000 << 32))


@njit(cache=True)
def _parse_digits(buf, start, end, out, w):
    """Fast path for a list of single digits without spaces ("[0,1,1]"): strided, no branch per
    element. Returns the count, or -1 (`_parse_ints` then decides)."""
    cnt = (end - start) // 2
    bad = False
    for i in range(cnt):
        d = np.int64(buf[start + 1 + 2 * i]) - 48
        bad |= np.uint64(d) > np.uint64(9)
        out[w + i] = d
    for i in range(cnt - 1):
        bad |= buf[start + 2 + 2 * i] != 44
    return -1 if bad else cnt


@njit(cache=True)
def _parse_uints_swar(buf, words, start, end, out, w, hi):
    """Fast path of `_parse_ints` for lists of non-negative integers of <= 7 digits, separated by
    ',' or ', ': one unaligned 8-byte load per element (`words[p]` = bytes p..p+7), a SWAR digit
    mask and combine, no branch per digit. Returns the count, or -1 for any other text."""
    n8 = words.shape[0]
    p = start + 1
    e = 0
    while True:
        while buf[p] == 32:
            p += 1
        if p >= n8:
            return -1
        v = words[p] ^ _ASCII0  # digits become 0..9, every other byte >= 10
        m = ((v + _NONDIGIT_ADD) | v) & _HIGH_BITS
        if m == _U(0):
            return -1
        nd = np.int64(trailing_zeros(m)) >> 3
        if nd == 0 or (nd > 1 and (v & _U(0xFF)) == _U(0)):
            return -1  # not a digit, or a leading zero
        val = v << _U(8 * (8 - nd))
        val = val * _U(10) + (val >> _U(8))
        val = (((val & _PAIR_MASK) * _MUL1) + (((val >> _U(16)) & _PAIR_MASK) * _MUL2)) >> _U(32)
        if val > _U(hi):
            return -1
        out[w + e] = val
        e += 1
        p += nd
        c = buf[p]
        if c == 44:
            p += 1
        elif c == 93 and p == end - 1:
            return e
        else:
            return -1


@njit(cache=True)
def _parse_ints(buf, start, end, out, w, lo, hi):
    """Parse the integer list buf[start:end] ('[' .. ']') into out[w:]; returns the count or -1."""
    p = start + 1
    stop = end - 1
    e = 0
    while True:
        p = _skip_ws(buf, p, stop)
        neg = False
        if p < stop and buf[p] == 45:
            neg = True
            p += 1
        if p >= stop or not (48 <= buf[p] <= 57):
            return -1
        v = 0
        if buf[p] == 48:
            p += 1
            if p < stop and 48 <= buf[p] <= 57:
                return -1  # leading zero: not JSON
        else:
            nd = 0
            while p < stop and 48 <= buf[p] <= 57:
                v = v * 10 + (buf[p] - 48)
                nd += 1
                p += 1
                if nd > 10:
                    return -1
        if p < stop and (buf[p] == 46 or buf[p] == 101 or buf[p] == 69):
            return -1  # a float: the Python checks name it
        if neg:
            v = -v
        if v < lo or v > hi:
            return -1
        out[w + e] = v
        e += 1
        p = _skip_ws(buf, p, stop)
        if p == stop:
            return e
        if buf[p] != 44:
            return -1
        p += 1


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


@njit(cache=True)
def _parse_floats(buf, start, end, out, w, pow10, fix_pos, fix_a, fix_b, X):
    """Parse the number list buf[start:end] into float32 out[w:].

    Returns (count or -1, X, fix_pos, fix_a, fix_b): elements whose float32 needs Python's float()
    are appended to fix_pos / fix_a / fix_b (output position, text span); X counts them.
    """
    p = start + 1
    stop = end - 1
    e = 0
    while True:
        p = _skip_ws(buf, p, stop)
        a = p
        neg = False
        if p < stop and buf[p] == 45:
            neg = True
            p += 1
        if p >= stop or not (48 <= buf[p] <= 57):
            return -1, X, fix_pos, fix_a, fix_b  # NaN, Infinity, or not a number: the Python checks name it
        m = np.uint64(0)
        sig = 0
        e10 = 0
        truncated = False
        is_int = True
        if buf[p] == 48:
            p += 1
            if p < stop and 48 <= buf[p] <= 57:
                return -1, X, fix_pos, fix_a, fix_b
        else:
            while p < stop and 48 <= buf[p] <= 57:
                d = buf[p] - 48
                if sig < 19:
                    m = m * np.uint64(10) + np.uint64(d)
                    sig += 1
                else:
                    e10 += 1
                    truncated = truncated or d != 0
                p += 1
        if p < stop and buf[p] == 46:
            is_int = False
            p += 1
            if p >= stop or not (48 <= buf[p] <= 57):
                return -1, X, fix_pos, fix_a, fix_b
            while p < stop and 48 <= buf[p] <= 57:
                d = buf[p] - 48
                if sig < 19 and (m != 0 or d != 0):
                    m = m * np.uint64(10) + np.uint64(d)
                    sig += 1
                    e10 -= 1
                elif m == 0:
                    e10 -= 1
                else:
                    truncated = truncated or d != 0
                p += 1
        if p < stop and (buf[p] == 101 or buf[p] == 69):
            is_int = False
            p += 1
            eneg = False
            if p < stop and (buf[p] == 43 or buf[p] == 45):
                eneg = buf[p] == 45
                p += 1
            if p >= stop or not (48 <= buf[p] <= 57):
                return -1, X, fix_pos, fix_a, fix_b
            ex = 0
            while p < stop and 48 <= buf[p] <= 57:
                if ex < 100000:
                    ex = ex * 10 + (buf[p] - 48)
                p += 1
            e10 += -ex if eneg else ex
        b = p
        if is_int and sig > 18:
            return -1, X, fix_pos, fix_a, fix_b  # may be outside int64: the Python checks name it
        fix = False
        if m == 0:
            x = 0.0
        else:
            exact = sig <= 15 and not truncated and -22 <= e10 <= 22
            if e10 > 308 or e10 < -308:
                fix = True
                x = 1.0
            else:
                x = float(m)
                if e10 >= 0:
                    x = x * pow10[e10]
                else:
                    x = x / pow10[-e10]
            if not fix:
                ax = abs(x)
                if ax > _F32_MAX * 1.001:
                    return -1, X, fix_pos, fix_a, fix_b  # not a finite float32: the Python checks name it
                if ax < _F32_TINY * 1.001 or ax > _F32_MAX * 0.999:
                    fix = True  # subnormal or near overflow: float() decides
                elif not exact:
                    low = np.int64(np.float64(x).view(np.uint64) & np.uint64((1 << 29) - 1))
                    if abs(low - (1 << 28)) <= 64:
                        fix = True  # near a float32 rounding midpoint
        if fix:
            fix_pos = grow(fix_pos, X)
            fix_a = grow(fix_a, X)
            fix_b = grow(fix_b, X)
            fix_pos[X] = w + e
            fix_a[X] = a
            fix_b[X] = b
            X += 1
            out[w + e] = 0.0
        else:
            if neg:
                x = -x if not (is_int and m == 0) else 0.0
            out[w + e] = np.float32(x)
        e += 1
        p = _skip_ws(buf, p, stop)
        if p == stop:
            return e, X, fix_pos, fix_a, fix_b
        if buf[p] != 44:
            return -1, X, fix_pos, fix_a, fix_b
        p += 1
    return -1, X, fix_pos, fix_a, fix_b


@njit(cache=True)
def _parse_int_list(buf, words, start, end, count, out, w, lo, hi):
    """The integer list buf[start:end] into out[w:], fastest applicable path first; count or -1."""
    got = -1
    if end - start == 2 * count + 1:
        got = _parse_digits(buf, start, end, out, w)
    if got != count:
        got = _parse_uints_swar(buf, words, start, end, out, w, hi)
    if got != count:
        got = _parse_ints(buf, start, end, out, w, lo, hi)
    return got


@njit(cache=True)
def parse_all(buf, words, c_field, c_start, c_end, c_count, tok, mask, flt, flt_base, pow10):
    """Parse every candidate list into its field's buffer.

    Returns (offset [A]: start in the field's buffer, -1 where the list stays in the skeleton;
    used [5]: elements written per field; fix_pos, fix_a, fix_b [X]; fix_list [X]).
    """
    A = c_field.shape[0]
    offset = np.full(A, -1, np.int64)
    used = np.zeros(5, np.int64)
    fix_pos = np.empty(16, np.int64)
    fix_a = np.empty(16, np.int64)
    fix_b = np.empty(16, np.int64)
    fix_list = np.empty(16, np.int64)
    X = 0
    for k in range(A):
        f = c_field[k]
        w = used[f]
        if f == 0:
            got = _parse_int_list(buf, words, c_start[k], c_end[k], c_count[k], tok, w, _INT32_MIN, _INT32_MAX)
        elif f == 1:
            got = _parse_int_list(buf, words, c_start[k], c_end[k], c_count[k], mask, w, 0, 255)
        else:
            X0 = X
            got, X, fix_pos, fix_a, fix_b = _parse_floats(buf, c_start[k], c_end[k], flt, flt_base[f] + w, pow10,
                                                          fix_pos, fix_a, fix_b, X)
            if got != c_count[k]:
                X = X0
            for x in range(X0, X):
                fix_list = grow(fix_list, x)
                fix_list[x] = k
        if got == c_count[k]:
            offset[k] = w
            used[f] = w + got
    return offset, used, fix_pos[:X], fix_a[:X], fix_b[:X], fix_list[:X]


def overlapping_words(data) -> np.ndarray:
    """uint64 [n-7] overlapping little-endian words: element p holds bytes p..p+7 (stride 1 byte)."""
    n = len(data)
    if n < 8:
        return np.zeros(0, np.uint64)
    return np.lib.stride_tricks.as_strided(np.frombuffer(data, "<u8", count=n // 8), shape=(n - 7,), strides=(1,))


def fix_floats(data, flt, offset, fix_pos, fix_a, fix_b, fix_list) -> None:
    """Convert the recorded elements with float() (as the JSON decoders do); a list whose element
    is not a finite float32 goes back to the skeleton."""
    for pos, a, b, k in zip(fix_pos.tolist(), fix_a.tolist(), fix_b.tolist(), fix_list.tolist()):
        if offset[k] < 0:
            continue
        with np.errstate(over="ignore"):
            value = np.float32(float(bytes(data[a:b])))
        if not np.isfinite(value):
            offset[k] = -1
        else:
            flt[pos] = value
