"""The one hand-written protobuf codec of the planner: a microbatch's linear-attention calls.

    fill_linear_calls(msg, sched, src_kind, src_state, ex_seq, ex_depth, ex_state, n_calls)

`Microbatch.linear_calls` is the one nested, per-sequence part of a plan (why it is not built
through the generated API: docs/design/plan-contract.md, "Conventions"). `encode_linear_calls`
writes it in Numba, only implicit-presence scalar fields with tags < 16 and one packed bytes field,
so the bytes are the canonical ones protobuf produces (fields in tag order, zeros omitted);
`fill_linear_calls_ref`, through the generated API, is the twin the plain-Python builder uses
(tests/planner_service/test_build_kernels.py checks that both give identical messages).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.planner.level1 import group_by
from proto.arrays import pack
from proto.harts.v1 import plan_pb2


@njit(cache=True)
def _varint_len(v):
    u = np.uint64(v)  # negative int32/int64 values take 10 bytes (two's complement)
    n = 1
    while u >= np.uint64(128):
        u >>= np.uint64(7)
        n += 1
    return n


@njit(cache=True)
def _put_varint(buf, k, v):
    u = np.uint64(v)
    while u >= np.uint64(128):
        buf[k] = np.uint8((u & np.uint64(127)) | np.uint64(128))
        u >>= np.uint64(7)
        k += 1
    buf[k] = np.uint8(u)
    return k + 1


@njit(cache=True)
def _field_len(v):
    """Bytes of an implicit-presence int field (tag < 16) holding v: 0 when v == 0."""
    return 0 if v == 0 else 1 + _varint_len(v)


@njit(cache=True)
def _put_field(buf, k, tag, v):
    if v == 0:
        return k
    buf[k] = np.uint8(tag)
    return _put_varint(buf, k + 1, v)


@njit(cache=True)
def _seq_size(q, q_start, q_end, q_depth, r_off, src_kind, src_state, ex_off, ex_depth, ex_state):
    n_rep = r_off[q + 1] - r_off[q]
    size = 0
    if n_rep:
        size += 1 + _varint_len(4 * n_rep) + 4 * n_rep
    size += _field_len(q_start[q]) + _field_len(q_end[q]) + _field_len(q_depth[q])
    init = _field_len(src_kind[q]) + _field_len(src_state[q])
    size += 1 + _varint_len(init) + init  # init_state is always present
    for e in range(ex_off[q], ex_off[q + 1]):
        ex = _field_len(ex_state[e]) + _field_len(ex_depth[e])
        size += 1 + _varint_len(ex) + ex
    return size


@njit(cache=True)
def encode_linear_calls(q_start, q_end, q_depth, q_call, r_off, r_rows, src_kind, src_state, ex_seq, ex_depth,
                        ex_state, n_calls):
    """Wire bytes of `Microbatch.linear_calls` (field 16): n_calls LinearCall messages, each with
    its sequences in sequence order (Numba; parse them into the message with MergeFromString).

    Args:
        q_start, q_end, q_depth, q_call: int32 [Q] sequences (min_calls.schedule); r_off int64
            [Q+1], r_rows int32 [*] their replay rows.
        src_kind, src_state: int32 [Q] StateSource of each sequence's initial state.
        ex_seq, ex_depth, ex_state: int64 [E] state exports, sorted by (sequence, depth, state).

    Returns:
        uint8 [*] the encoded fields; the same bytes protobuf writes for the same messages.
    """
    Q = q_start.shape[0]
    ex_off = np.zeros(Q + 1, np.int64)
    for e in range(ex_seq.shape[0]):
        ex_off[ex_seq[e] + 1] += 1
    for q in range(Q):
        ex_off[q + 1] += ex_off[q]
    seq_size = np.empty(Q, np.int64)
    call_size = np.zeros(n_calls, np.int64)
    for q in range(Q):
        sz = _seq_size(q, q_start, q_end, q_depth, r_off, src_kind, src_state, ex_off, ex_depth, ex_state)
        seq_size[q] = sz
        call_size[q_call[q]] += 1 + _varint_len(sz) + sz
    total = 0
    for c in range(n_calls):
        total += 2 + _varint_len(call_size[c]) + call_size[c]
    # sequences of each call, in sequence order
    by_call, first = group_by(q_call, n_calls)
    buf = np.empty(total, np.uint8)
    k = 0
    for c in range(n_calls):
        buf[k] = np.uint8(0x82)  # field 16, length-delimited
        buf[k + 1] = np.uint8(0x01)
        k = _put_varint(buf, k + 2, call_size[c])
        for j in range(first[c], first[c + 1]):
            q = by_call[j]
            buf[k] = np.uint8(0x0A)  # LinearCall.sequences
            k = _put_varint(buf, k + 1, seq_size[q])
            n_rep = r_off[q + 1] - r_off[q]
            if n_rep:
                buf[k] = np.uint8(0x0A)  # replay_rows, little-endian int32
                k = _put_varint(buf, k + 1, 4 * n_rep)
                for i in range(r_off[q], r_off[q + 1]):
                    v = np.uint32(np.int32(r_rows[i]))
                    for b in range(4):
                        buf[k] = np.uint8((v >> np.uint32(8 * b)) & np.uint32(255))
                        k += 1
            k = _put_field(buf, k, 0x10, q_start[q])
            k = _put_field(buf, k, 0x18, q_end[q])
            k = _put_field(buf, k, 0x20, q_depth[q])
            buf[k] = np.uint8(0x2A)  # init_state
            k = _put_varint(buf, k + 1, _field_len(src_kind[q]) + _field_len(src_state[q]))
            k = _put_field(buf, k, 0x08, src_kind[q])
            k = _put_field(buf, k, 0x10, src_state[q])
            for e in range(ex_off[q], ex_off[q + 1]):
                buf[k] = np.uint8(0x32)  # exports
                k = _put_varint(buf, k + 1, _field_len(ex_state[e]) + _field_len(ex_depth[e]))
                k = _put_field(buf, k, 0x08, ex_state[e])
                k = _put_field(buf, k, 0x10, ex_depth[e])
    return buf


def fill_linear_calls(msg: plan_pb2.Microbatch, sched: tuple, src_kind, src_state, ex_seq, ex_depth, ex_state,
                      n_calls: int) -> None:
    """Append a microbatch's linear-attention calls to `msg` through `encode_linear_calls`.

    Args:
        sched: `min_calls.schedule` of the microbatch (q_start, q_end, q_depth, q_init, q_call,
            r_off, r_rows, seq_of_row); the other arguments as in `encode_linear_calls`.
    """
    q_start, q_end, q_depth, _, q_call, r_off, r_rows, _ = sched
    msg.MergeFromString(encode_linear_calls(
        q_start, q_end, q_depth, q_call, r_off, r_rows, src_kind, src_state, ex_seq, ex_depth, ex_state, n_calls,
    ).tobytes())


def fill_linear_calls_ref(msg: plan_pb2.Microbatch, sched: tuple, src_kind, src_state, ex_seq, ex_depth, ex_state,
                          n_calls: int) -> None:
    """Plain-Python twin of `fill_linear_calls`: the same calls through the protobuf API."""
    q_start, q_end, q_depth, _, q_call, r_off, r_rows, _ = sched
    calls = [plan_pb2.LinearCall() for _ in range(n_calls)]
    exports: dict[int, list[tuple[int, int]]] = {}
    for q, depth, sid in zip(ex_seq.tolist(), ex_depth.tolist(), ex_state.tolist()):
        exports.setdefault(q, []).append((sid, depth))
    for q in range(len(q_start)):
        seq = calls[int(q_call[q])].sequences.add(
            replay_rows=pack(r_rows[r_off[q] : r_off[q + 1]], "int32"),
            row_start=int(q_start[q]), row_end=int(q_end[q]), start_depth=int(q_depth[q]),
        )
        seq.init_state.kind = int(src_kind[q])
        seq.init_state.state = int(src_state[q])
        for sid, depth in exports.get(q, []):
            seq.exports.add(state=sid, depth=depth)
    msg.linear_calls.extend(calls)
