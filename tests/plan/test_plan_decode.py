"""plan.decode: every planner microbatch decodes to the arrays its wire fields hold, and
out-of-range indices are rejected naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from plan.microbatch import PlanValidationError, decode_microbatch
from plan.window_exports import ATTN, CONV, KERNEL, export_needs
from planner_service.planner import PlanConfig, plan_step
from proto.arrays import pack, unpack
from tests.builder_helpers import forest_from_trajectories, random_trajectories


def _plan(windows: bool = True, microbatch_tokens: int = 48):
    rng = np.random.default_rng(3)
    trajs, tree_of = random_trajectories(rng, n=24, max_len=60, trees=3, chunk=8)
    forest = forest_from_trajectories(trajs, tree_of=tree_of)
    return plan_step(forest, PlanConfig(chunk_size=8, microbatch_tokens=microbatch_tokens, memory_tokens=4096, windows=windows))


def test_decode_matches_wire_fields():
    plan = _plan()
    mbs = [mb for r in plan.ranks for mb in r.microbatches]
    assert any(len(mb.import_row) for mb in mbs), "expected sharing windows in the test plan"
    for mb in mbs:
        a = decode_microbatch(mb, plan.header.params)
        assert a.num_rows == mb.num_rows and a.num_imports == len(mb.import_row) // 4
        assert np.array_equal(a.tokens, unpack(mb.tokens, "int32"))
        assert np.array_equal(a.conv_ancestors.reshape(-1), unpack(mb.conv_ancestors, "int32"))
        assert len(a.linear_calls) == len(mb.linear_calls)
        for ca, call in zip(a.linear_calls, mb.linear_calls):
            assert ca.num_sequences == len(call.sequences)
            for n, seq in enumerate(call.sequences):
                assert (ca.row_start[n], ca.row_end[n], ca.init_kind[n]) == (seq.row_start, seq.row_end, seq.init_state.kind)
                got = ca.replay_rows[ca.replay_offsets[n] : ca.replay_offsets[n + 1]]
                assert np.array_equal(got, unpack(seq.replay_rows, "int32"))
        assert a.state_import_microbatch.shape[0] == len(mb.state_imports)


@pytest.mark.parametrize("field,value,match", [
    ("lp_row", lambda mb: pack(np.full(len(mb.lp_row) // 4, mb.num_rows), "int32"), "lp_row: expected local rows"),
    ("tokens", lambda mb: pack([1] * (mb.num_rows + 1), "int32"), "tokens: expected"),
    ("conv_ancestors", lambda mb: pack([10**6] * (3 * mb.num_rows), "int32"), "conv_ancestors"),
    ("attn_ranges", lambda mb: pack([[0, mb.num_rows + len(mb.import_row) // 4 + 1]], "int32"), "attn_"),
], ids=["lp_row", "tokens", "conv", "attn"])
def test_decode_rejects_out_of_range(field, value, match):
    plan = _plan()
    mb = plan.ranks[0].microbatches[0]
    setattr(mb, field, value(mb))
    with pytest.raises(PlanValidationError, match=match):
        decode_microbatch(mb, plan.header.params)


def test_decode_rejects_bad_state_reference():
    plan = _plan()
    mb = next(mb for r in plan.ranks for mb in r.microbatches if len(mb.linear_calls))
    mb.linear_calls[0].sequences[0].init_state.kind = 1
    mb.linear_calls[0].sequences[0].init_state.state = mb.num_states + 5
    with pytest.raises(PlanValidationError, match="init_state"):
        decode_microbatch(mb, plan.header.params)


def test_export_needs_cover_every_import():
    plan = _plan()
    p = plan.header.params
    checked = 0
    for rank in plan.ranks:
        mbs = {mb.id: decode_microbatch(mb, p) for mb in rank.microbatches}
        order = [rank.microbatches[s.microbatch].id for s in rank.steps if s.kind == 0]
        needs = export_needs(mbs, order)
        for m, a in mbs.items():
            if m in needs:
                n = needs[m]
                assert np.array_equal(n.states, np.unique(a.export_states))
                assert np.isin(n.rows[ATTN], a.export_rows).all()
                assert np.array_equal(n.rows[ATTN], np.unique(a.export_rows))  # every import is an attention ancestor
                assert np.isin(n.rows[CONV], n.rows[ATTN]).all() and np.isin(n.rows[KERNEL], n.rows[ATTN]).all()
            R = a.num_rows
            # every imported row a consumer reads is exported by its exporter under that kind
            conv = a.conv_ancestors.reshape(-1)
            for i in np.unique(conv[conv >= R] - R).tolist():
                e, r = int(a.import_microbatch[i]), int(a.import_row[i])
                assert r in set(needs[e].rows[CONV].tolist())
                checked += 1
            for call in a.linear_calls:
                rep = call.replay_rows
                for i in np.unique(rep[rep >= R] - R).tolist():
                    e, r = int(a.import_microbatch[i]), int(a.import_row[i])
                    assert r in set(needs[e].rows[KERNEL].tolist())
                    checked += 1
    assert checked > 0


def _late_sequence(plan):
    """A microbatch and a sequence of it that is neither its first call nor that call's first."""
    for mb in (mb for r in plan.ranks for mb in r.microbatches):
        for c, call in enumerate(mb.linear_calls[1:], 1):
            if len(call.sequences) > 1:
                return mb, c, len(call.sequences) - 1, call.sequences[-1]
    raise AssertionError("expected a later call with several sequences in the test plan")


def _export(seq, state):
    seq.exports.add(state=state, depth=seq.start_depth + 8)


@pytest.mark.parametrize("mutate,match", [
    (lambda mb, seq: setattr(seq, "row_end", mb.num_rows + 1), r": expected 0 <= row_start < row_end"),
    (lambda mb, seq: setattr(seq, "replay_rows", pack([mb.num_rows + len(mb.import_row) // 4], "int32")),
     r"\.replay_rows: expected extended rows"),
    (lambda mb, seq: setattr(seq, "replay_rows", b"\0\0\0"), r"\.replay_rows: expected a multiple of 4 bytes"),
    (lambda mb, seq: setattr(seq.init_state, "kind", 7), r"\.init_state\.kind: expected ZERO, LOCAL or IMPORTED"),
    (lambda mb, seq: (setattr(seq.init_state, "kind", 2), setattr(seq.init_state, "state", len(mb.state_imports))),
     r"\.init_state: expected a state id < len\(state_imports\)"),
    (lambda mb, seq: _export(seq, mb.num_states), r"\.exports: expected state ids in \[0, "),
], ids=["row-range", "replay-row", "replay-bytes", "state-kind", "imported-state-id", "export-state"])
def test_decode_rejects_bad_sequences_naming_call_and_sequence(mutate, match):
    """The flat bounds pass over all calls names the offending call and its sequence index."""
    plan = _plan(microbatch_tokens=192)
    mb, c, q, seq = _late_sequence(plan)
    mutate(mb, seq)
    with pytest.raises(PlanValidationError, match=rf"microbatch {mb.id}\.linear_calls\[{c}\]\.sequences\[{q}\]" + match):
        decode_microbatch(mb, plan.header.params)
