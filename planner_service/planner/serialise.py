"""Write the plan's wire messages: the header, every microbatch, the cross edges and every rank's steps.

    fill_header(plan.header, forest, cfg)
    arrays[m] = serialise_microbatch(msg, layouts[m], forest, cfg, k, ext[m], sources[m], lp, occ_seg)
    edges = fill_cross_edges(plan, cfg, arrays, steps, topo)
    rank_costs, peak = fill_steps(plan, cfg, steps, rank_order, mbs, arrays, edges)

`serialise_microbatch` returns the MicrobatchArrays that decoding the message gives (no decoding
pass; docs/design/plan-contract.md). Legend: R local rows, I imported rows, J = K - 1 conv ancestors, Q sequences, P entries.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import microbatch_features
from planner_service.planner.logprob_map import LogprobMap, loss_per_trajectory
from planner_service.planner.row_layout import Layout
from proto.arrays import pack as pk
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.cross_edges import CrossEdgeArrays, edge_bytes, held_bytes, remote_imports, sent_needs
from plan.memory_model import rank_live_bytes
from plan.microbatch import LinearCallArrays, MicrobatchArrays
from plan.phases import PHASE_BACKWARD, PHASE_FORWARD
from plan.seal import PLAN_VERSION
from plan.window_exports import ATTN, CONV, KERNEL, export_needs, import_needs


def fill_header(h: plan_pb2.PlanHeader, forest: Forest, cfg: PlanConfig) -> None:
    """The header: version, step id, parameters, memory and cost models, normalisers, the trajectory table."""
    h.version = PLAN_VERSION
    h.step_id = forest.batch_id
    p = h.params
    p.world_size = cfg.world_size
    p.microbatch_tokens = cfg.microbatch_tokens
    p.memory_tokens = cfg.memory_tokens
    p.chunk_size = cfg.chunk_size
    p.conv_kernel = cfg.conv_kernel
    p.vocab_size = forest.vocab_size
    p.sharing = cfg.sharing
    p.windows = cfg.windows
    p.replay = cfg.replay
    p.logprob_positions = plan_pb2.LOGPROB_POSITIONS_ALL if cfg.all_positions else plan_pb2.LOGPROB_POSITIONS_LOSS
    p.lockstep = cfg.lockstep
    p.cross_rank_windows = cfg.crossing
    cfg.sizes.fill(p.memory, cfg.memory_tokens)
    p.memory.model = cfg.model_name
    p.memory.dtype = cfg.dtype
    # the defaults stay unset, so that plans without checkpointing are the bytes they were
    p.memory.activation_checkpointing = "" if cfg.activation_checkpointing == "none" else cfg.activation_checkpointing
    p.memory.head = "" if cfg.head == "full" else cfg.head
    cfg.cost_model.fill(p.cost_model, transfer=cfg.crossing)
    n = h.normalizers
    T = forest.num_trajectories
    per_traj = loss_per_trajectory(forest.traj_offset, forest.loss_mask).astype(np.float64)
    n.total_loss_tokens = float(per_traj.sum())
    n.num_trajectories = T
    n.traj_loss_tokens = pk(per_traj, "float32")
    weight = forest.weight if forest.weight.shape[0] == T else np.ones(T, np.float32)
    n.traj_weight = pk(weight, "float32")
    h.trajectory_ids.extend(forest.traj_ids)
    h.trajectory_lengths = pk(forest.traj_length(), "int32")
    h.tree_ids.extend(forest.tree_ids)
    if forest.policy_version is not None:
        h.policy_version = forest.policy_version
    reward = forest.reward if forest.reward.shape[0] == T else np.zeros(T, np.float32)
    h.trajectory_rewards = pk(reward, "float32")


def serialise_microbatch(msg: plan_pb2.Microbatch, L: Layout, forest: Forest, cfg: PlanConfig, k: SimpleNamespace,
                         ext: tuple[np.ndarray, np.ndarray], source: tuple[np.ndarray, np.ndarray], lp: LogprobMap,
                         occ_seg: np.ndarray) -> MicrobatchArrays:
    """Write microbatch L into `msg`; returns the MicrobatchArrays that decoding `msg` gives."""
    P = L.packed
    R = L.num_rows
    ext_parent, ext_depth = ext
    msg.id, msg.num_rows, msg.recompute = L.mb, R, bool(L.spec.recompute)
    tokens_R = forest.tokens[L.local_tok]
    occ_R = k.row_occurrence(P["row_seg"], L.seg_forest, L.seg_dup, occ_seg)
    conv_RJ = k.conv_ancestors(ext_parent, R, cfg.conv_kernel)
    offs, ranges = k.attn_ranges(P["seg_start"], P["seg_length"], P["seg_parent"], P["row_parent"], ext_parent)
    seg_tree = forest.seg_tree[L.seg_forest]
    for name, a, dtype in (
        ("tokens", tokens_R, "int32"), ("depth", P["row_depth"], "int32"), ("occurrence", occ_R, "int32"),
        ("seg_start", P["seg_start"], "int32"), ("seg_length", P["seg_length"], "int32"),
        ("seg_parent", P["seg_parent"], "int32"), ("seg_tree", seg_tree, "int32"), ("seg_forest", L.seg_forest, "int32"),
        ("seg_forest_offset", L.seg_forest_offset, "int32"), ("seg_duplicated", L.seg_dup, "uint8"),
        ("conv_ancestors", conv_RJ, "int32"), ("attn_offsets", offs, "int32"), ("attn_ranges", ranges, "int32"),
    ):
        setattr(msg, name, pk(a, dtype))

    _, _, _, _, q_call, _, r_rows, seq_of_row = L.sched
    n_calls = int(q_call.max()) + 1 if q_call.shape[0] else 0
    # state exports: (sequence, depth, state) of every state this microbatch computes
    st_rows = np.fromiter(L.states.keys(), np.int64, len(L.states))
    st_ids = np.fromiter(L.states.values(), np.int64, len(L.states))
    ex_seq = seq_of_row[st_rows].astype(np.int64)
    ex_depth = ext_depth[st_rows].astype(np.int64) + 1
    o = np.lexsort((st_ids, ex_depth, ex_seq))
    ex_seq, ex_depth, ex_state = ex_seq[o], ex_depth[o], st_ids[o]
    src_kind, src_state = source
    k.fill_linear_calls(msg, L.sched, src_kind, src_state, ex_seq, ex_depth, ex_state, n_calls)
    msg.num_states = len(L.states)

    if L.shared:
        msg.import_microbatch = pk(np.full(L.ctx_tok.shape[0], L.spec.parent), "int32")
        msg.import_row = pk(L.import_row, "int32")
    for e, sid in L.state_imports:
        msg.state_imports.add(microbatch=e, state=sid)
    msg.export_rows = pk(L.export_rows, "int32")
    msg.export_states = pk(sorted(L.export_states), "int32")

    a, b = lp.bounds[L.mb], lp.bounds[L.mb + 1]
    for name, dtype, col in lp.fields:
        setattr(msg, name, pk(lp.columns[col][a:b], dtype))

    replay = int(r_rows.shape[0])
    msg.replay_tokens = replay
    msg.duplicated_tokens = int(P["seg_length"][L.seg_dup == 1].sum())
    feats = microbatch_features(R, replay, P["row_depth"], ext_depth[r_rows], n_calls, lp.columns[1][a:b])
    msg.cost = float(cfg.cost_model.cost(*feats))
    return _arrays(msg, L, P, tokens_R, occ_R, conv_RJ, offs, ranges, src_kind, src_state, ex_seq, ex_depth,
                   ex_state, n_calls, seg_tree, {name: lp.columns[col][a:b] for name, _, col in lp.fields})


def fill_cross_edges(plan: plan_pb2.Plan, cfg: PlanConfig, arrays: dict[int, MicrobatchArrays], steps,
                     topo: list[int]) -> list[CrossEdgeArrays]:
    """Windows across ranks (plan.cross_edges): one CrossEdge per (exporter, importer) on different
    ranks, with the rows and states the importer and its own importers read of the exporter
    (`plan.window_exports.import_needs` over the step's export needs), sent at the end of the phase
    before the importer's FORWARD, their gradients at the end of the importer's BACKWARD phase
    (so the importer holds the received exports exactly while its window is open); ids in order of
    (importer, exporter), written to both ranks' cross_edges. Empty in a plan without them."""
    rank_of = {m: r for r, rs in enumerate(steps) for _, m in rs if m >= 0}
    pairs = []
    for m in topo:
        a = arrays[m]
        for x in sorted(set(a.import_microbatch.tolist()) | set(a.state_import_microbatch.tolist())):
            if rank_of[x] != rank_of[m]:
                pairs.append((m, x))
    if not pairs:
        return []
    phase_of: dict[tuple[str, int], int] = {}
    for rs in steps:
        for i, (kind, m) in enumerate(rs):
            if m >= 0:
                phase_of[kind, m] = i
    needs = export_needs(arrays, topo)  # every exporter's needs, its importers on every rank included
    edges = []
    reads: dict[int, dict] = {}
    for i, x in sorted(pairs):
        if i not in reads:
            reads[i] = import_needs(arrays[i], needs.get(i))
        nd = reads[i][x]
        edges.append(CrossEdgeArrays(
            id=len(edges), exporter=x, exporter_rank=rank_of[x], importer=i, importer_rank=rank_of[i], rows=nd.rows,
            states=nd.states, send_phase=phase_of["F", i] - 1, grad_phase=phase_of["B", i], bytes=edge_bytes(cfg.sizes, nd)))
    for e in edges:
        for r in (e.exporter_rank, e.importer_rank):
            plan.ranks[r].cross_edges.add(
                id=e.id, exporter=e.exporter, exporter_rank=e.exporter_rank, importer=e.importer,
                importer_rank=e.importer_rank, attn_rows=pk(e.rows[ATTN], "int32"), conv_rows=pk(e.rows[CONV], "int32"),
                kernel_rows=pk(e.rows[KERNEL], "int32"), states=pk(e.states, "int32"), send_phase=e.send_phase,
                grad_phase=e.grad_phase, bytes=e.bytes)
    return edges


def fill_steps(plan: plan_pb2.Plan, cfg: PlanConfig, steps, rank_order: list[list[int]],
               mbs: dict[int, plan_pb2.Microbatch], arrays: dict[int, MicrobatchArrays],
               edges: list[CrossEdgeArrays]) -> tuple[list[float], int]:
    """Write every rank's execution steps; returns the rank costs and the peak live bytes (with
    windows across ranks: the exporters' remote needs and the exports an importer holds).

    Stand-ins (microbatch -1, lock-step plans) pair up last in, first out: a BACKWARD stand-in in
    a PHASE_BACKWARD phase takes the latest unpaired FORWARD stand-in's graph (a fresh id k > 0
    for both); other FORWARD stand-ins, and those of PHASE_RECOMPUTE phases, get id 0.
    """
    phases = unpack(plan.header.lockstep_phases, "uint8").tolist()
    rank_costs = []
    peak = 0
    for r in range(cfg.world_size):
        rp = plan.ranks[r]
        local = {m: i for i, m in enumerate(rank_order[r])}
        unpaired: list[plan_pb2.ExecStep] = []
        for i, (kind, m) in enumerate(steps[r]):
            step = rp.steps.add(kind=plan_pb2.ExecStep.FORWARD if kind == "F" else plan_pb2.ExecStep.BACKWARD,
                                microbatch=local[m] if m >= 0 else -1)
            if m >= 0:
                continue
            if phases[i] == PHASE_FORWARD:
                unpaired.append(step)
            elif phases[i] == PHASE_BACKWARD:
                if not unpaired:
                    raise PlanningError(f"partition.rank_steps[{r}][{i}]: a BACKWARD stand-in without an earlier FORWARD stand-in")
                step.standin = unpaired.pop().standin = len(rp.steps)  # unique on the rank, > 0
        rank_costs.append(float(sum(mbs[m].cost for m in rank_order[r])))
        real = [(kind == "F", m) for kind, m in steps[r] if m >= 0]
        held = held_bytes(edges, r, len(steps[r]))[[i for i, (_, m) in enumerate(steps[r]) if m >= 0]] if edges else None
        _, rank_peak = rank_live_bytes(cfg.sizes, {m: arrays[m] for m in rank_order[r]}, real,
                                       sent=sent_needs(edges, r), remote=remote_imports(edges, r), held=held)
        peak = max(peak, rank_peak)
    return rank_costs, peak


def _arrays(msg, L: Layout, P: dict, tokens_R, occ_R, conv_RJ, offs, ranges, src_kind, src_state, ex_seq, ex_depth,
            ex_state, n_calls: int, seg_tree, lp_cols: dict) -> MicrobatchArrays:
    """The MicrobatchArrays that `plan.decode.decode_microbatch(msg)` returns, from the
    builder's own arrays (no decoding pass; tests/planner_service/test_plan_builder.py compares the two)."""
    q_start, q_end, q_depth, _, q_call, r_off, r_rows, _ = L.sched
    calls = []
    ex_seq = np.asarray(ex_seq, np.int64)
    for c in range(n_calls):
        seqs = np.flatnonzero(q_call == c)
        lens = r_off[seqs + 1] - r_off[seqs]
        pos = np.full(q_call.shape[0], -1, np.int64)
        pos[seqs] = np.arange(seqs.shape[0])
        sel = np.flatnonzero(pos[ex_seq] >= 0) if ex_seq.shape[0] else np.zeros(0, np.int64)
        calls.append(LinearCallArrays(
            row_start=q_start[seqs].astype(np.int64), row_end=q_end[seqs].astype(np.int64),
            start_depth=q_depth[seqs].astype(np.int64), init_kind=np.asarray(src_kind, np.int64)[seqs],
            init_state=np.asarray(src_state, np.int64)[seqs],
            replay_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            replay_rows=np.concatenate([r_rows[r_off[q]:r_off[q + 1]] for q in seqs]).astype(np.int64) if seqs.shape[0] else np.zeros(0, np.int64),
            export_seq=pos[ex_seq[sel]], export_depth=np.asarray(ex_depth, np.int64)[sel],
            export_state=np.asarray(ex_state, np.int64)[sel],
        ))
    I = L.ctx_tok.shape[0] if L.shared else 0
    return MicrobatchArrays(
        id=int(msg.id), num_rows=L.num_rows, num_imports=I, num_states=len(L.states), recompute=bool(L.spec.recompute),
        tokens=tokens_R, depth=P["row_depth"], occurrence=occ_R, seg_start=P["seg_start"], seg_length=P["seg_length"],
        seg_parent=P["seg_parent"], seg_tree=seg_tree, seg_forest=L.seg_forest, seg_forest_offset=L.seg_forest_offset,
        seg_duplicated=L.seg_dup, conv_ancestors=conv_RJ, attn_offsets=offs, attn_ranges=ranges, linear_calls=calls,
        import_microbatch=np.full(I, L.spec.parent, np.int32), import_row=L.import_row if I else np.zeros(0, np.int32),
        state_import_microbatch=np.array([o for o, _ in L.state_imports], np.int32),
        state_import_state=np.array([sid for _, sid in L.state_imports], np.int32),
        export_rows=L.export_rows, export_states=np.array(sorted(L.export_states), np.int32),
        lp_row=lp_cols["lp_row"], lp_label=lp_cols["lp_label"], lp_traj=lp_cols["lp_traj"], lp_pos=lp_cols["lp_pos"],
        lp_loss_mask=lp_cols["lp_loss_mask"], lp_advantage=lp_cols["lp_advantage"],
        lp_old_logprob=_optional(lp_cols, "lp_old_logprob"), lp_ref_logprob=_optional(lp_cols, "lp_ref_logprob"),
        replay_tokens=int(msg.replay_tokens), duplicated_tokens=int(msg.duplicated_tokens), cost=float(msg.cost),
    )


def _optional(lp_cols: dict, name: str) -> np.ndarray | None:
    """An optional log-prob column as decode_microbatch reads it: None when absent from entries."""
    a = lp_cols.get(name, np.zeros(0, np.float32))
    return a if a.shape[0] or not lp_cols["lp_row"].shape[0] else None


