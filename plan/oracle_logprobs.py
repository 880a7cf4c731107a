"""The oracle validator's log-prob rules: every entry once, and its row's token chain and label right.

    check_logprobs(header, all_mbs, st, forest_like)

Without `forest_like` consecutive entries of a trajectory must chain (prefix hashes, `oracle_rows`);
with it every row reproduces the trajectory prefix and every label and loss mask is the forest's.
Part of `plan.validator` (docs/design/plan-contract.md). Legend: T trajectories, P log-prob entries.
"""
from __future__ import annotations

import numpy as np

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.microbatch import PlanValidationError
from plan.oracle_rows import CheckedMicrobatch, StepRows, hash_terms


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def check_logprobs(header, all_mbs: dict[int, CheckedMicrobatch], st: StepRows, forest_like) -> None:
    lengths = unpack(header.trajectory_lengths, "int32").astype(np.int64)
    T = lengths.shape[0]
    parts = [(m, mb) for m, mb in sorted(all_mbs.items()) if mb.P]
    if not parts:
        traj = pos = row_hash = label = mask = np.zeros(0, np.int64)
    else:
        traj = np.concatenate([mb.lp_traj for _, mb in parts]).astype(np.int64)
        pos = np.concatenate([mb.lp_pos for _, mb in parts]).astype(np.int64)
        label = np.concatenate([mb.lp_label for _, mb in parts]).astype(np.int64)
        mask = np.concatenate([mb.lp_loss_mask for _, mb in parts]).astype(np.int64)
        row_hash = np.concatenate([st.hash[m][mb.lp_row] for m, mb in parts])
    if ((traj < 0) | (traj >= T)).any():
        _fail("lp_traj", f"expected trajectory indices in [0, {T})")
    if ((pos < 1) | (pos >= lengths[traj] if T else pos >= 0)).any():
        _fail("lp_pos", "expected positions in [1, L) of their trajectory")
    key = traj * (int(lengths.max()) + 1 if T else 1) + pos
    order = np.argsort(key, kind="stable") if forest_like is None else None  # the chain check needs the order
    skey = key[order] if order is not None else np.sort(key)
    if (np.diff(skey) == 0).any():
        if order is None:
            order = np.argsort(key, kind="stable")
        i = int(order[np.flatnonzero(np.diff(key[order]) == 0)[0]])
        _fail("lp_pos", f"trajectory {int(traj[i])} position {int(pos[i])} has more than one log-prob entry")
    all_pos = header.params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_ALL
    if all_pos and key.shape[0] != int(np.maximum(lengths - 1, 0).sum()):
        _fail("lp_pos", f"expected an entry for every position 1..L-1 ({int(np.maximum(lengths - 1, 0).sum())}), got {key.shape[0]}")
    if forest_like is None:
        # consecutive entries of one trajectory must chain: hash(row at p+1) = hash(row at p) extended by label p
        t, p, h, lab = traj[order], pos[order], row_hash[order], label[order]
        nxt = (t[1:] == t[:-1]) & (p[1:] == p[:-1] + 1)
        want = h[:-1] + hash_terms(lab[:-1], p[:-1])  # the label at position p sits at depth p
        if (nxt & (h[1:] != want)).any():
            i = int(np.flatnonzero(nxt & (h[1:] != want))[0])
            _fail("lp_label", f"trajectory {int(t[i])} position {int(p[i])}: label or row does not chain with position {int(p[i]) + 1}")
        return
    offs = np.asarray(forest_like.traj_offset, np.int64)
    loss = np.asarray(forest_like.loss_mask).astype(np.int64)
    if offs.shape[0] != T + 1 or not np.array_equal(np.diff(offs), lengths):
        _fail("header.trajectory_lengths", "expected the forest's trajectory lengths")
    want_n = key.shape[0] if all_pos else int(loss.sum() - loss[offs[:-1]].sum()) if T else 0
    if key.shape[0] != want_n:
        _fail("lp_pos", f"expected {want_n} log-prob entries (every loss position >= 1), got {key.shape[0]}")
    g = offs[traj] + pos
    if (mask != loss[g]).any():
        _fail("lp_loss_mask", "expected the trajectory's loss mask at each entry")
    toks = np.concatenate([np.asarray(forest_like.path_tokens(t), np.int64) for t in range(T)]) if T else np.zeros(0, np.int64)
    if toks.shape[0] != offs[-1]:
        _fail("forest_like", f"expected {int(offs[-1])} trajectory tokens, got {toks.shape[0]}")
    at = np.arange(toks.shape[0]) - np.repeat(offs[:-1], lengths)
    with np.errstate(over="ignore"):
        cs = np.cumsum(hash_terms(toks, at), dtype=np.uint64)
        start = np.where(offs[:-1] > 0, cs[np.maximum(offs[:-1] - 1, 0)], np.uint64(0)) if T else cs[:0]
        want_hash = cs[g - 1] - start[traj]
    bad = np.flatnonzero(row_hash != want_hash)
    if bad.shape[0]:
        i = int(bad[0])
        _fail("lp_row", f"trajectory {int(traj[i])} position {int(pos[i])}: the row's token chain does not reproduce the trajectory prefix")
    bad = np.flatnonzero(label != toks[g])
    if bad.shape[0]:
        i = int(bad[0])
        _fail("lp_label", f"trajectory {int(traj[i])} position {int(pos[i])}: expected label {int(toks[g[i]])}, got {int(label[i])}")
