"""Test helpers for the executor: a small, independent tree-plan maker (no planner_service).

`make_plan(trajs, ...)` builds a `plan_pb2.Plan` from token lists with a plain trie. Rows are packed
depth-first per microbatch; every segment is one linear sequence that starts at the chunk boundary
at or before its first depth, replays the path rows in between (<= C-1) and starts from the state
the covering ancestor sequence exports there (not the minimum number of calls: a different,
simpler schedule than the planner's, which is the point of an oracle). `replay=False` starts each
segment at its own depth from the parent's end state. Microbatches (`groups`, trajectory index
lists) without windows: a row shared with an earlier microbatch is duplicated (occurrence 0, no
log-prob entries); log-prob entries live where the row of token i-1 is kept.
`sharing=False` gives every trajectory its own tree (the expanded baseline).

`lockstep_plan(plan)` turns any plan (this maker's or the plan builder's, windows and
recomputation included) into a lock-step plan: one global sequence of phases with stand-ins
(docs/design/lockstep.md), aligned greedily here, independently of the planner's phase builder.

`cross_rank_plan(plan, importer, dst)` moves a window's importer, with the block of its rank's
steps from its FORWARD to its BACKWARD (its own importers, and any window opened above it), to
another rank of a lock-step plan, and emits the windows across ranks (`CrossEdge`) that the move
creates: the same step, computed with windows that cross ranks (docs/design/cross-rank.md).
"""
from __future__ import annotations

import numpy as np

from proto.arrays import pack
from proto.harts.v1 import plan_pb2
from plan.seal import PLAN_VERSION


class _Node:
    __slots__ = ("tok", "kids", "depth", "parent", "trajs", "uid")

    def __init__(self, tok, depth, parent, uid):
        self.tok, self.depth, self.parent, self.uid = tok, depth, parent, uid
        self.kids: dict = {}
        self.trajs: list[int] = []


def _trie(trajs, tree_of, sharing):
    roots: dict = {}
    ends, uid = [], 0
    for t, traj in enumerate(trajs):
        key = tree_of[t] if sharing else f"traj-{t}"
        level, parent = roots.setdefault(key, {}), None
        for d, tok in enumerate(traj):
            if tok not in level:
                level[tok] = _Node(tok, d, parent, uid)
                uid += 1
            node = level[tok]
            node.trajs.append(t)
            parent, level = node, node.kids
        ends.append(parent)
    return roots, ends


def make_plan(
    trajs: list[list[int]],
    *,
    chunk_size: int,
    vocab_size: int = 256,
    conv_kernel: int = 4,
    groups: list[list[int]] | None = None,
    sharing: bool = True,
    replay: bool = True,
    loss_masks: list[list[int]] | None = None,
    advantages: list[float] | None = None,
    old_logprobs: list[list[float]] | None = None,
    ref_logprobs: list[list[float]] | None = None,
    weights: list[float] | None = None,
    tree_of: list[str] | None = None,
    all_positions: bool = False,
) -> plan_pb2.Plan:
    T, C, J = len(trajs), chunk_size, conv_kernel - 1
    tree_of = tree_of or [""] * T
    loss_masks = loss_masks or [[0] + [1] * (len(x) - 1) for x in trajs]
    advantages = advantages or [1.0] * T
    weights = weights or [1.0] * T
    groups = groups or [list(range(T))]
    roots, ends = _trie(trajs, tree_of, sharing)
    tree_ids = sorted(roots)
    kept_in: dict[int, tuple[int, int]] = {}  # node uid -> (microbatch, row)
    plan = plan_pb2.Plan()
    h = plan.header
    h.version, h.step_id = PLAN_VERSION, "test"
    p = h.params
    p.world_size, p.microbatch_tokens, p.chunk_size, p.conv_kernel, p.vocab_size = 1, 1 << 20, C, conv_kernel, vocab_size
    p.sharing, p.windows, p.replay = sharing, False, replay
    p.logprob_positions = plan_pb2.LOGPROB_POSITIONS_ALL if all_positions else plan_pb2.LOGPROB_POSITIONS_LOSS
    h.trajectory_ids.extend([f"t{t}" for t in range(T)])
    h.trajectory_lengths = pack([len(x) for x in trajs], "int32")
    h.tree_ids.extend(tree_ids)
    tl = np.array([sum(m[1:]) for m in loss_masks], np.float32)  # position 0 never has a log-prob
    h.normalizers.total_loss_tokens = float(tl.sum())
    h.normalizers.num_trajectories = T
    h.normalizers.traj_loss_tokens = pack(tl, "float32")
    h.normalizers.traj_weight = pack(weights, "float32")
    h.stats.expanded_tokens = sum(len(x) for x in trajs)
    rank = plan.ranks.add()
    for g, members in enumerate(groups):
        # Nodes of this microbatch: union of its trajectories' paths, as segments (split where branching
        # or where a member trajectory ends, or where kept/duplicated status changes).
        member_set = set(members)
        on_path = {}
        for t in members:
            n = ends[t]
            while n is not None:
                on_path[n.uid] = n
                n = n.parent
        rows: list[_Node] = []
        segs = []  # (start_row, length, parent_seg)
        seg_of_row = []

        def kids_of(n):
            return [k for k in n.kids.values() if k.uid in on_path]

        def walk(n, parent_seg):
            s = len(segs)
            segs.append([len(rows), 0, parent_seg])
            cur = n
            while True:
                rows.append(cur)
                seg_of_row.append(s)
                segs[s][1] += 1
                ks = kids_of(cur)
                ends_here = any(ends[t] is cur for t in member_set)
                dup_change = len(ks) == 1 and ((ks[0].uid in kept_in) != (cur.uid in kept_in))
                if len(ks) != 1 or ends_here or dup_change:
                    break
                cur = ks[0]
            for k in sorted(ks, key=lambda k: k.tok):
                walk(k, s)

        for key in tree_ids:
            for r in sorted(roots[key].values(), key=lambda n: n.tok):
                if r.uid in on_path:
                    walk(r, -1)
        R = len(rows)
        row_of = {n.uid: i for i, n in enumerate(rows)}
        dup = np.array([n.uid in kept_in for n in rows])
        for i, n in enumerate(rows):
            if n.uid not in kept_in:
                kept_in[n.uid] = (g, i)

        def path_row(i, depth):
            n = rows[i]
            while n.depth > depth:
                n = n.parent
            return row_of[n.uid]

        mb = rank.microbatches.add()
        mb.id, mb.num_rows = g, R
        mb.tokens = pack([n.tok for n in rows], "int32")
        mb.depth = pack([n.depth for n in rows], "int32")
        mb.occurrence = pack([0 if dup[i] else len(n.trajs) for i, n in enumerate(rows)], "int32")
        S = len(segs)
        mb.seg_start = pack([s[0] for s in segs], "int32")
        mb.seg_length = pack([s[1] for s in segs], "int32")
        mb.seg_parent = pack([s[2] for s in segs], "int32")
        mb.seg_tree = pack([0] * S, "int32")
        mb.seg_forest = pack(range(S), "int32")
        mb.seg_forest_offset = pack([0] * S, "int32")
        mb.seg_duplicated = pack([int(dup[s[0]]) for s in segs], "uint8")
        conv = np.full((R, J), -1, np.int64)
        for i, n in enumerate(rows):
            for j in range(J):
                d = n.depth - (J - j)
                if d >= 0:
                    conv[i, j] = path_row(i, d)
        mb.conv_ancestors = pack(conv, "int32")
        offs, rngs = [0], []
        for s in segs:
            chain, q = [], s[2]
            while q >= 0:
                chain.append((segs[q][0], segs[q][0] + segs[q][1]))
                q = segs[q][2]
            rngs += chain[::-1]
            offs.append(len(rngs))
        mb.attn_offsets = pack(offs, "int32")
        mb.attn_ranges = pack(np.array(rngs, np.int64).reshape(-1, 2), "int32")
        # Linear schedule: one sequence per segment.
        seg_call, seg_start_depth, exports_of = [0] * S, [0] * S, {}
        seqs_by_call: dict[int, list] = {}
        n_states = 0
        for s, (a, ln, par) in enumerate(segs):
            d = rows[a].depth
            start = (d // C) * C if replay else d
            replay_rows = [path_row(a, x) for x in range(start, d)] if d > start else []
            if start == 0:
                src, call = (plan_pb2.StateSource.ZERO, 0), 0
            else:
                # the sequence covering depth start-1 on this path
                prov = seg_of_row[path_row(a, start - 1)]
                key = (prov, start)
                if key not in exports_of:
                    exports_of[key] = n_states
                    n_states += 1
                src, call = (plan_pb2.StateSource.LOCAL, exports_of[key]), seg_call[prov] + 1
            seg_call[s], seg_start_depth[s] = call, start
            seqs_by_call.setdefault(call, []).append((s, replay_rows, src))
        for c in range(max(seqs_by_call) + 1 if seqs_by_call else 0):
            lc = mb.linear_calls.add()
            for s, replay_rows, src in seqs_by_call.get(c, []):
                sq = lc.sequences.add()
                sq.replay_rows = pack(replay_rows, "int32")
                sq.row_start, sq.row_end = segs[s][0], segs[s][0] + segs[s][1]
                sq.start_depth = seg_start_depth[s]
                sq.init_state.kind, sq.init_state.state = src
                for (prov, depth), sid in sorted(exports_of.items(), key=lambda kv: kv[1]):
                    if prov == s:
                        ex = sq.exports.add()
                        ex.state, ex.depth = sid, depth
        mb.num_states = n_states
        lp = {k: [] for k in ("row", "label", "traj", "pos", "mask", "old", "ref", "adv")}
        for t in range(T):
            n, path = ends[t], []
            while n is not None:
                path.append(n)
                n = n.parent
            path = path[::-1]
            for i in range(1, len(path)):
                if not (all_positions or loss_masks[t][i]):
                    continue
                mbi, row = kept_in.get(path[i - 1].uid, (-1, -1))
                if mbi != g:
                    continue
                lp["row"].append(row)
                lp["label"].append(path[i].tok)
                lp["traj"].append(t)
                lp["pos"].append(i)
                lp["mask"].append(loss_masks[t][i])
                lp["adv"].append(advantages[t])
                if old_logprobs:
                    lp["old"].append(old_logprobs[t][i])
                if ref_logprobs:
                    lp["ref"].append(ref_logprobs[t][i])
        for k, field_ in (("row", "lp_row"), ("label", "lp_label"), ("traj", "lp_traj"), ("pos", "lp_pos")):
            setattr(mb, field_, pack(lp[k], "int32"))
        mb.lp_loss_mask = pack(lp["mask"], "uint8")
        mb.lp_advantage = pack(lp["adv"], "float32")
        mb.lp_old_logprob = pack(lp["old"], "float32")
        mb.lp_ref_logprob = pack(lp["ref"], "float32")
        for kind in (plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD):
            st = rank.steps.add()
            st.kind, st.microbatch = kind, g
    return plan


def lockstep_plan(plan: plan_pb2.Plan) -> plan_pb2.Plan:
    """The same plan as a lock-step plan (docs/design/lockstep.md), aligned here independently of the planner.

    Every rank keeps its real steps in their order. Phases are chosen greedily: the phase kind most
    ranks' next steps have (FORWARD first on ties); a rank whose next step is of another kind gets
    a stand-in: FORWARD 0 (no graph) in a forward phase, BACKWARD 0 (forward and backward) in a
    recompute phase, and in a backward phase BACKWARD k paired with the rank's latest unpaired
    FORWARD 0, which becomes FORWARD k. A rank without such a forward makes the helper insert a
    forward phase first (the rank takes a stand-in there).
    """
    F, B, R = plan_pb2.PHASE_FORWARD, plan_pb2.PHASE_BACKWARD, plan_pb2.PHASE_RECOMPUTE
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    out.header.params.lockstep = True
    queues = []
    for r in out.ranks:
        order = [(s.kind, s.microbatch) for s in r.steps] or [
            (k, i) for i in range(len(r.microbatches)) for k in (plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD)]
        queues.append([(k, i, F if k == plan_pb2.ExecStep.FORWARD else R if r.microbatches[i].recompute else B)
                       for k, i in order])
    W = len(queues)
    steps: list[list[tuple[int, int, int]]] = [[] for _ in range(W)]
    free: list[list[int]] = [[] for _ in range(W)]
    next_id = [1] * W
    phases: list[int] = []

    def standin(r: int, phase: int) -> None:
        if phase == F:
            free[r].append(len(steps[r]))
            steps[r].append((plan_pb2.ExecStep.FORWARD, -1, 0))
        elif phase == R:
            steps[r].append((plan_pb2.ExecStep.BACKWARD, -1, 0))
        else:
            j, k = free[r].pop(), next_id[r]
            next_id[r] += 1
            steps[r][j] = (plan_pb2.ExecStep.FORWARD, -1, k)
            steps[r].append((plan_pb2.ExecStep.BACKWARD, -1, k))

    def take(r: int, phase: int) -> None:
        if queues[r] and queues[r][0][2] == phase:
            kind, i, _ = queues[r].pop(0)
            steps[r].append((kind, i, 0))
        else:
            standin(r, phase)

    while any(queues):
        nexts = [q[0][2] for q in queues if q]
        chosen = max((F, B, R), key=lambda k: (nexts.count(k), -k))
        if chosen == B:
            needy = [r for r in range(W) if not (queues[r] and queues[r][0][2] == B) and not free[r]]
            if needy:
                phases.append(F)
                for r in range(W):
                    standin(r, F) if r in needy else take(r, F)
                continue
        phases.append(chosen)
        for r in range(W):
            take(r, chosen)
    out.header.lockstep_phases = pack(np.array(phases, np.uint8), "uint8")
    for r, rank in enumerate(out.ranks):
        del rank.steps[:]
        for kind, i, k in steps[r]:
            rank.steps.add(kind=kind, microbatch=i, standin=k)
    _lockstep_stats(out)
    return out


def _lockstep_stats(plan: plan_pb2.Plan) -> None:
    """PlanStats.lockstep_* of a lock-step plan, by `plan.phases`' cost model, and the statistics
    of its cross edges (what the validator checks)."""
    from plan.cross_edges import decode_edges, held_bytes, remote_imports, sent_needs, transfer_bytes
    from plan.microbatch import decode_microbatch
    from plan.memory_model import RowSizes, rank_live_bytes
    from plan.phases import lockstep_phases, phase_counts, step_cost

    phases = lockstep_phases(plan.header)
    st = plan.header.stats
    st.lockstep_phases = phases.shape[0]
    st.lockstep_forward_phases, st.lockstep_backward_phases, st.lockstep_recompute_phases = phase_counts(phases)
    tb = plan.header.params.cost_model.transfer_byte
    slowest = np.zeros(phases.shape[0])
    for r in plan.ranks:
        cost = np.zeros(phases.shape[0])
        for i, (s, phase) in enumerate(zip(r.steps, phases.tolist())):
            if s.microbatch >= 0:
                cost[i] = step_cost(phase, r.microbatches[s.microbatch].cost)
        slowest = np.maximum(slowest, cost + tb * transfer_bytes(decode_edges(r), r.rank, phases.shape[0]))
    edges = {e.id: e for r in plan.ranks for e in r.cross_edges}
    moved = [sum(2 * e.bytes for e in r.cross_edges) for r in plan.ranks]
    st.cross_edges, st.exchanged_bytes = len(edges), 2 * sum(e.bytes for e in edges.values())
    st.max_rank_exchanged_bytes = max(moved) if edges else 0
    if len(st.rank_transfer_costs) or tb:
        del st.rank_transfer_costs[:]
        st.rank_transfer_costs.extend(tb * x for x in moved)
    sizes, peak = RowSizes.from_proto(plan.header.params.memory), 0  # microbatches may have moved between ranks
    for r in plan.ranks:
        edges, real = decode_edges(r), [i for i, s in enumerate(r.steps) if s.microbatch >= 0]
        arrays = {mb.id: decode_microbatch(mb, plan.header.params) for mb in r.microbatches}
        steps = [(r.steps[i].kind == plan_pb2.ExecStep.FORWARD, r.microbatches[r.steps[i].microbatch].id) for i in real]
        peak = max(peak, rank_live_bytes(sizes, arrays, steps, sent=sent_needs(edges, r.rank), remote=remote_imports(edges, r.rank),
                                         held=held_bytes(edges, r.rank, len(r.steps))[real])[1])
    st.peak_live_bytes, st.peak_live_tokens = peak, sizes.tokens(peak)
    del st.rank_costs[:]
    st.rank_costs.extend(float(sum(mb.cost for mb in r.microbatches)) for r in plan.ranks)
    transfer = list(st.rank_transfer_costs) or [0.0] * len(plan.ranks)
    st.makespan = max(c + t for c, t in zip(st.rank_costs, transfer))
    st.makespan_ratio = st.makespan / st.makespan_lower_bound if st.makespan_lower_bound > 0 else 1.0
    st.lockstep_makespan = float(slowest.sum())
    st.lockstep_ratio = st.lockstep_makespan / st.makespan if st.makespan > 0 else 1.0


def _standin_id(rank: plan_pb2.RankPlan) -> int:
    return max((s.standin for s in rank.steps), default=0) + 1


def cross_rank_plan(plan: plan_pb2.Plan, importer: int, dst: int, rng: np.random.Generator | None = None) -> plan_pb2.Plan:
    """`plan` (lock-step) with microbatch `importer` (a window child) and the block of its rank's
    real steps from its FORWARD to its BACKWARD moved to rank `dst`.

    The block's phases (its real steps only) are inserted right after the importer's BACKWARD
    phase: rank `dst` runs the block there, every other rank stand-ins (a FORWARD stand-in paired
    with the BACKWARD of the same microbatch, graph-less FORWARD 0 / RECOMPUTE 0 for a recomputed
    one); on the importer's old rank the block's steps become the same stand-ins. Every window
    from a microbatch outside the block (still open on the old rank: it was opened before the
    block and closes after it) to one inside becomes a `CrossEdge` carrying exactly what the
    importer reads (`plan.window_exports.import_needs`), sent in a phase between the exporter's
    FORWARD and the importer's, its gradients back between the importer's BACKWARD and the
    exporter's (`rng` picks them; None: the last and the first possible phase).
    """
    from plan.cross_edges import decode_edges, edge_bytes, remote_imports, sent_needs
    from plan.microbatch import decode_microbatch
    from plan.memory_model import RowSizes
    from plan.window_exports import export_needs, import_needs

    F, B = plan_pb2.PHASE_FORWARD, plan_pb2.PHASE_BACKWARD
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    assert out.header.params.lockstep, "cross_rank_plan needs a lock-step plan"
    phases = list(np.frombuffer(out.header.lockstep_phases, np.uint8))
    src = next(r for r in out.ranks if any(mb.id == importer for mb in r.microbatches))
    dst_rank = out.ranks[dst]
    assert src.rank != dst, "the importer is on rank dst already"
    involved = {x for r in out.ranks for e in r.cross_edges for x in (e.exporter, e.importer)}
    ids = [mb.id for mb in src.microbatches]
    steps = [(s.kind, s.microbatch, s.standin) for s in src.steps]
    f0 = next(p for p, (k, i, _) in enumerate(steps) if i >= 0 and ids[i] == importer and k == plan_pb2.ExecStep.FORWARD)
    b0 = next(p for p, (k, i, _) in enumerate(steps) if i >= 0 and ids[i] == importer and k == plan_pb2.ExecStep.BACKWARD)
    block = [p for p in range(f0, b0 + 1) if steps[p][1] >= 0]
    moved = {ids[steps[p][1]] for p in block}
    assert not moved & involved, "the block holds a microbatch of an existing cross edge"
    params = out.header.params
    arrays = {mb.id: decode_microbatch(mb, params) for mb in src.microbatches}
    order = [ids[i] for k, i, _ in steps if i >= 0 and k == plan_pb2.ExecStep.FORWARD]
    edges = decode_edges(src)
    needs = export_needs(arrays, order, sent=sent_needs(edges, src.rank), remote=remote_imports(edges, src.rank))
    pairs = []  # (exporter outside the block, importer inside, what it reads)
    for x in sorted(moved):
        for e, nd in import_needs(arrays[x], needs.get(x)).items():
            if e not in moved:
                pairs.append((e, x, nd))
    assert pairs, f"microbatch {importer} imports from no window outside its block"

    # the block's phases, right after the importer's BACKWARD; stand-ins mirror them elsewhere
    ins, L = b0 + 1, len(block)
    kinds = [phases[p] for p in block]
    new_phases = phases[:ins] + kinds + phases[ins:]

    def mirror(first_id):
        """Stand-ins for the block's real steps: FORWARD x paired with BACKWARD x."""
        k, pair, got = first_id, {}, []
        for p in block:
            kind, i, _ = steps[p]
            if phases[p] == F:
                recompute = src.microbatches[i].recompute
                pair[i] = 0 if recompute else k
                k += 0 if recompute else 1
                got.append((kind, -1, pair[i]))
            else:
                got.append((kind, -1, pair.pop(i) if phases[p] == B else 0))
        return got

    new_index = {}  # moved microbatch id -> index on dst
    for mb in src.microbatches:
        if mb.id in moved:
            new_index[mb.id] = len(dst_rank.microbatches)
            dst_rank.microbatches.add().CopyFrom(mb)
    keep = [mb for mb in src.microbatches if mb.id not in moved]
    src_index = {mb.id: j for j, mb in enumerate(keep)}
    for r in out.ranks:
        old = [(s.kind, s.microbatch, s.standin) for s in r.steps]
        if r.rank == src.rank:
            standins = dict(zip(block, mirror(_standin_id(r))))
            old = [standins[p] if p in standins else (k, i if i < 0 else src_index[ids[i]], sid)
                   for p, (k, i, sid) in enumerate(old)]
            inserted = mirror(max((s for _, _, s in old), default=0) + 1)
        elif r.rank == dst:
            inserted = [(steps[p][0], new_index[ids[steps[p][1]]], 0) for p in block]
        else:
            inserted = mirror(_standin_id(r))
        del r.steps[:]
        for kind, i, sid in old[:ins] + inserted + old[ins:]:
            r.steps.add(kind=kind, microbatch=i, standin=sid)
    del src.microbatches[:]
    src.microbatches.extend(keep)
    for r in out.ranks:  # the edges of earlier moves: their phases after the insertion move with it
        for e in r.cross_edges:
            e.send_phase += L if e.send_phase >= ins else 0
            e.grad_phase += L if e.grad_phase >= ins else 0
    out.header.lockstep_phases = pack(np.array(new_phases, np.uint8), "uint8")

    def phase_of(rank, mb_id, kind):
        idx = {m.id: j for j, m in enumerate(rank.microbatches)}[mb_id]
        return next(p for p, s in enumerate(rank.steps) if s.microbatch == idx and s.kind == kind)

    first = max((e.id for r in out.ranks for e in r.cross_edges), default=-1) + 1
    fwd, bwd = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD
    for n, (e, x, nd) in enumerate(pairs):
        lo, hi = phase_of(src, e, fwd), phase_of(dst_rank, x, fwd) - 1
        glo, ghi = phase_of(dst_rank, x, bwd), phase_of(src, e, bwd) - 1
        assert lo <= hi and glo <= ghi, (lo, hi, glo, ghi)
        send = hi if rng is None else int(rng.integers(lo, hi + 1))
        grad = glo if rng is None else int(rng.integers(glo, ghi + 1))
        edge = plan_pb2.CrossEdge(
            id=first + n, exporter=e, exporter_rank=src.rank, importer=x, importer_rank=dst,
            attn_rows=pack(nd.rows["attn"], "int32"), conv_rows=pack(nd.rows["conv"], "int32"),
            kernel_rows=pack(nd.rows["kernel"], "int32"), states=pack(nd.states, "int32"),
            send_phase=send, grad_phase=grad, bytes=edge_bytes(RowSizes.from_proto(params.memory), nd))
        src.cross_edges.add().CopyFrom(edge)
        dst_rank.cross_edges.add().CopyFrom(edge)
    _lockstep_stats(out)
    return out


def window_importers(plan: plan_pb2.Plan) -> list[tuple[int, int]]:
    """(rank, microbatch id) of every microbatch that imports from a window, in rank order."""
    return [(r.rank, mb.id) for r in plan.ranks for mb in r.microbatches if len(mb.import_row) or len(mb.state_imports)]
