"""One step of an executor: each rank's walk over its steps, with its stack of open windows.

    walks = [RankWalk(ex, d) for d in decoded]     # one per DecodedSlice (plan.decode.decode_rank)
    run = StepRun(ex, header, norm, backward=True, walks=walks, before_last_backward=None)
    run.walk(w)  # or run.phases(transport) with windows across ranks; then run.result(seconds)

What a FORWARD keeps, what a BACKWARD backpropagates, how import leaves and export gradients
travel: docs/design/windows.md ("The walk"); stand-ins: docs/design/lockstep.md; cross edges:
docs/design/cross-rank.md. Legend: R rows, P log-prob entries, E experts.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kernels.devices import to_device
from plan.cross_edges import remote_imports, sent_needs
from plan.decode import BACKWARD, FORWARD, DecodedSlice
from plan.microbatch import MicrobatchArrays
from plan.window_exports import export_needs
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from trainer.boundary import kind_of
from trainer.cross_rank import RankEdges, Received
from trainer.layout import RowLayout, layout_from_arrays
from trainer.loss import MicrobatchLoss, expert_load
from trainer.models.qwen3_next import ModelOutput
from trainer.objectives import Normalizers
from trainer.probes import TrajectoryProbes

log = logging.getLogger("trainer.executor")

#: a step running longer than this logs its progress every this many seconds
PROGRESS_SECONDS = 10.0

__all__ = ["RankWalk", "StepResult", "StepRun"]


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one step produced. Losses are step totals (sums of microbatch losses)."""

    loss: float
    policy_loss: float
    kl: float
    entropy_bonus: float
    aux_loss: float
    expert_load: np.ndarray
    """int64 [MoE layers, E] trajectory-weighted routing counts (equal to the expanded batch's)."""
    computed_tokens: int
    """Rows run, replay rows included."""
    expanded_tokens: int
    loss_tokens: float
    microbatches: int
    seconds: float
    windows: int = 0
    """Microbatches that imported from a window ancestor."""
    recomputed_microbatches: int = 0
    """Window parents whose forward ran twice (activation recomputation)."""
    standins: int = 0
    """Lock-step stand-in steps run (phases where a rank had no real step of the phase's kind)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Sums over microbatches of the objective's `LossTerms.stats` (keys ending in _max / _min:
    max / min), for the trainer's metrics."""
    logprobs: dict[str, np.ndarray] | None = None
    """trajectory id -> float64 [L-1] log-probs of positions 1..L-1 (NaN without an entry)."""
    entropies: dict[str, np.ndarray] | None = None
    linear_outputs: dict[str, dict[int, np.ndarray]] | None = None
    """trajectory id -> layer -> [L-1, Hv, Vd] outputs at positions 0..L-2 (NaN without an entry;
    float32, float64 for a float64 model)."""

    def summary(self) -> dict:
        return {
            "loss": self.loss, "policy_loss": self.policy_loss, "kl": self.kl, "aux_loss": self.aux_loss,
            "computed_tokens": self.computed_tokens, "expanded_tokens": self.expanded_tokens,
            "microbatches": self.microbatches, "windows": self.windows,
            "recomputed_microbatches": self.recomputed_microbatches, "standins": self.standins,
            "seconds": round(self.seconds, 4),
        }



@dataclass(slots=True, kw_only=True)
class _Open:
    """A microbatch between its FORWARD and BACKWARD steps."""

    layout: RowLayout
    imports: dict[str, torch.Tensor]
    """Its import leaves by name (gradients accumulate on them; empty for a stand-in)."""
    exports: dict[str, torch.Tensor]
    """Its exports by name: with graph, or detached when it will be recomputed."""
    loss: torch.Tensor | None
    """The loss with graph (None when recomputed: the re-run provides it)."""
    recompute: bool
    sources: dict[int, "_Open | Received"] = field(default_factory=dict)
    """Exporter id -> where its imports came from (an open window here, or one across ranks)."""
    export_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> gradient its importers accumulated on the export."""


class RankWalk:
    """One rank's part of a step: its decoded slice, its open windows and stand-ins, its cross edges
    (`ex`: the `trainer.executor.Executor` running it)."""

    def __init__(self, ex, d: DecodedSlice):
        self.rank = d.rank
        self.arrays = d.by_id()
        self.ids = [a.id for a in d.microbatches]
        self.steps = [(kind, i, k) for (kind, i), k in zip(d.steps, d.standins)]
        self.phases = d.phases
        order = [self.ids[i] for kind, i, _ in self.steps if kind == FORWARD and i >= 0]
        self.needs = export_needs(self.arrays, order, sent=sent_needs(d.edges, d.rank),
                                  remote=remote_imports(d.edges, d.rank))
        self.edges = RankEdges(d.rank, d.edges, self.needs, ex.export_layout, ex.device) if d.edges else None
        self.open: dict[int, _Open] = {}
        self.standins: dict[int, _Open] = {}

    def finish(self) -> None:
        if self.open:
            raise ValueError(f"rank {self.rank}: microbatches {sorted(self.open)} were forwarded but never backwarded")


class StepRun:
    """One step's walk over the ranks' execution orders, with their stacks of open windows (`ex`: the
    `trainer.executor.Executor` running it: its model forward, config and device)."""

    def __init__(self, ex, header: plan_pb2.PlanHeader, norm: Normalizers, *, backward: bool,
                 walks: list[RankWalk], before_last_backward: Callable[[], None] | None):
        self.ex, self.header, self.norm, self.backward = ex, header, norm, backward
        cfg = ex.cfg
        self.probes = TrajectoryProbes(header, logprobs=cfg.want_logprobs, entropies=cfg.want_entropies,
                                       linear=cfg.capture_linear)
        zero = torch.zeros((), dtype=torch.float64, device=ex.device)
        self.totals = dict(loss=zero, policy=zero, kl=zero, ent=zero, aux=zero, loss_tokens=zero)
        self.stats: dict[str, torch.Tensor] = {}
        self.computed = self.n_mb = self.windows = self.recomputed = self.standins = 0
        self.load = torch.zeros(len(ex.moe_layers), max(ex.num_experts, 1), dtype=torch.float64, device=ex.device)
        self.walks = walks
        self.total_steps, self.steps_done = sum(len(w.steps) for w in walks), 0
        backwards = sum(kind == BACKWARD for w in walks for kind, _, _ in w.steps)
        self.backwards_left = backwards if backward else 0
        self.before_last_backward = before_last_backward
        self.t0 = self.last_report = time.perf_counter()

    def walk(self, w: RankWalk) -> None:
        """Every step of one rank, in order (a rank without windows across ranks)."""
        for p in range(len(w.steps)):
            self.step(w, p)
        w.finish()

    def phases(self, transport) -> None:
        """Every rank's step of each phase, then the phase's transfers of windows across ranks (a
        lock-step plan: step p of every rank runs in phase p)."""
        kinds = self.walks[0].phases.tolist()
        for p, kind in enumerate(kinds):
            for w in self.walks:
                self.step(w, p)
            moves = [(w, w.edges.transfers(p, w.open, backward=self.backward)) for w in self.walks if w.edges is not None]
            transport.run(p, [t for _, ts in moves for t in ts], kind)
            for w, ts in moves:
                w.edges.complete(ts, w.open)
        for w in self.walks:
            w.finish()

    def step(self, w: RankWalk, p: int) -> None:
        """Step p of rank w."""
        kind, i, standin = w.steps[p]
        if i < 0:
            self._standin(kind, standin, w.standins)
        elif kind == FORWARD:
            m = w.ids[i]
            w.open[m] = self._forward(w, w.arrays[m])
        else:
            m = w.ids[i]
            if m not in w.open:
                raise ValueError(f"rank {w.rank}: backward of microbatch {m} without an open forward")
            self._backward(m, w.open.pop(m))
        self._progress()

    def _standin(self, kind: int, standin: int, standins: dict[int, _Open]) -> None:
        """A lock-step stand-in: the collectives of a real step of its phase, with an exact zero loss."""
        self.standins += 1
        if kind == BACKWARD and not self.backward:
            return
        if kind == FORWARD:
            layout = self.ex.standin_layout(self.header.params)
            keep = bool(standin) and self.backward
            _, mb_loss = self.ex.forward(layout, None, self.norm, grad=keep)
            if keep:
                standins[standin] = _Open(layout=layout, imports={}, exports={}, loss=mb_loss.loss, recompute=False)
        elif standin:  # PHASE_BACKWARD: through the graph its FORWARD kept
            self._backward(-1, standins.pop(standin))
        else:  # PHASE_RECOMPUTE: forward and backward here
            layout = self.ex.standin_layout(self.header.params)
            self._backward(-1, _Open(layout=layout, imports={}, exports={}, loss=None, recompute=True))

    def _progress(self) -> None:
        """One log line every PROGRESS_SECONDS of a long step."""
        self.steps_done += 1
        now = time.perf_counter()
        if now - self.last_report >= PROGRESS_SECONDS and self.steps_done < self.total_steps:
            self.last_report = now
            log.info("step %s: %d/%d microbatch steps (forward/backward), %d rows so far, %.0f s",
                     self.header.step_id, self.steps_done, self.total_steps, self.computed, now - self.t0)

    def _forward(self, w: RankWalk, a: MicrobatchArrays) -> _Open:
        ex = self.ex
        needs = w.needs
        remote = w.edges.into(a.id) if w.edges is not None else {}
        if remote:  # the export tables of exporters on other ranks, as this importer receives them
            needs = {**needs, **remote}
        layout = layout_from_arrays(a, needs, chunk_size=ex.cfg.chunk_size, batch_invariant=ex.batch_invariant).to(ex.device)
        sources = self._sources(w, a, layout)
        imports = self._imports(layout, sources)
        # A recomputed forward runs without a graph: only a window parent needs it, but in a lock-step
        # plan every rank re-runs the forwards its phases say (PHASE_RECOMPUTE), exporter or not.
        recompute = bool(a.recompute and self.backward and (a.id in w.needs or self.header.params.lockstep))
        out, mb_loss = ex.forward(layout, imports, self.norm, grad=self.backward and not recompute)
        self._record(a, layout, out, mb_loss)
        if layout.window.imports_anything:
            self.windows += 1
        if recompute:
            self.recomputed += 1
        exports = {k: v.detach() for k, v in out.exports.items()} if not self.backward or recompute else out.exports
        return _Open(layout=layout, imports=imports, exports=exports, loss=None if recompute else mb_loss.loss,
                     recompute=recompute, sources=sources)

    @staticmethod
    def _sources(w: RankWalk, a: MicrobatchArrays, layout: RowLayout) -> dict[int, "_Open | Received"]:
        """Exporter id -> the open window (or the window across ranks) each of a's imports comes from."""
        received = w.edges.sources(a.id) if w.edges is not None else {}
        out: dict[int, _Open | Received] = {}
        for src in layout.window.import_from.values():
            for e in np.unique(src.exporter).tolist():
                if e in out:
                    continue
                got = received.get(e) if e not in w.open else w.open[e]
                if got is None:
                    raise ValueError(f"microbatch {a.id} imports from microbatch {e}, which is not an open window "
                                     f"on rank {w.rank} and no cross edge brought it")
                out[e] = got
        return out

    def _imports(self, layout: RowLayout, sources: dict[int, "_Open | Received"]) -> dict[str, torch.Tensor]:
        """Fresh leaves of the rows and states this microbatch imports, copied from its exporters."""
        w = layout.window
        imports: dict[str, torch.Tensor] = {}
        for kind, src in w.import_from.items():
            exporters = np.unique(src.exporter).tolist()
            names = [n for n in sources[exporters[0]].exports if kind_of(n) == kind]
            for name in names:
                if len(exporters) == 1:
                    t = sources[exporters[0]].exports[name].detach().index_select(0, to_device(torch.from_numpy(src.position), self.ex.device))
                else:
                    parts, order = [], []
                    for e in exporters:
                        sel = np.flatnonzero(src.exporter == e)
                        pos = to_device(torch.from_numpy(src.position[sel]), self.ex.device)
                        parts.append(sources[e].exports[name].detach().index_select(0, pos))
                        order.append(sel)
                    inv = np.empty(src.exporter.shape[0], np.int64)
                    inv[np.concatenate(order)] = np.arange(src.exporter.shape[0])
                    t = torch.cat(parts).index_select(0, to_device(torch.from_numpy(inv), self.ex.device))
                imports[name] = t.requires_grad_(self.backward)
        return imports

    def _backward(self, m: int, st: _Open) -> None:
        if not self.backward:
            return
        ex = self.ex
        loss, exports = st.loss, st.exports
        if st.recompute:
            out, mb_loss = ex.forward(st.layout, st.imports, self.norm, grad=True)
            if ex.cfg.check_recompute and m >= 0:
                for name, t in st.exports.items():
                    if not torch.equal(out.exports[name].detach(), t):
                        raise AssertionError(f"microbatch {m}: recomputed export {name} differs from the first forward's")
            loss, exports = mb_loss.loss, out.exports
        tensors, grads = [], []
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(None)
        for name, g in st.export_grads.items():
            t = exports[name]
            if t.requires_grad:
                tensors.append(t)
                grads.append(g)
        self.backwards_left -= 1
        if self.backwards_left == 0 and self.before_last_backward is not None:
            self.before_last_backward()
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._hand_back(st)

    def _hand_back(self, st: _Open) -> None:
        """Accumulate the gradients of st's import leaves on its exporters' exports (an open window
        here, or a window across ranks that sends them back at its grad_phase)."""
        w = st.layout.window
        for name, leaf in st.imports.items():
            if leaf.grad is None:
                continue
            src = w.import_from[kind_of(name)]
            for e in np.unique(src.exporter).tolist():
                sel = np.flatnonzero(src.exporter == e)
                g = leaf.grad if sel.shape[0] == src.exporter.shape[0] else leaf.grad.index_select(0, to_device(torch.from_numpy(sel), leaf.device))
                pos = to_device(torch.from_numpy(src.position[sel]), leaf.device)
                target = st.sources[e]
                acc = target.export_grads.get(name)
                if acc is None:
                    acc = target.export_grads[name] = torch.zeros_like(target.exports[name])
                acc.index_add_(0, pos, g)

    def _record(self, a: MicrobatchArrays, layout: RowLayout, out: ModelOutput, mb_loss: MicrobatchLoss) -> None:
        """Step totals, expert loads and probes of one microbatch (from its first forward only),
        accumulated on the device: nothing is read back until `result`."""
        t = mb_loss.terms
        parts = {"loss": mb_loss.loss, "policy": t.policy, "kl": t.kl, "ent": t.entropy, "aux": mb_loss.aux,
                 "loss_tokens": layout.logprobs.loss_mask.sum()}
        for k, v in parts.items():
            self.totals[k] = self.totals[k] + v.detach().double()
        for k, v in (getattr(t, "stats", None) or {}).items():
            v = v.detach().double()
            old = self.stats.get(k)
            if old is None:
                self.stats[k] = v
            elif k.endswith("_max"):
                self.stats[k] = torch.maximum(old, v)
            elif k.endswith("_min"):
                self.stats[k] = torch.minimum(old, v)
            else:
                self.stats[k] = old + v
        self.computed += layout.num_rows + a.num_replay_rows
        self.n_mb += 1
        if self.ex.moe_layers:
            self.load = self.load + expert_load(out.router_topk, layout.occurrence, self.ex.moe_layers, self.ex.num_experts)
        self.probes.add(layout, mb_loss.logprob, mb_loss.entropy, out.linear)

    def result(self, seconds: float) -> StepResult:
        """The step's figures, read from the device once."""
        names = list(self.totals) + list(self.stats)
        values = torch.stack([*self.totals.values(), *self.stats.values()]).tolist()
        got = dict(zip(names, values))
        tot = {k: got[k] for k in self.totals}
        stats = {k: got[k] for k in self.stats}
        lengths = unpack(self.header.trajectory_lengths, "int32", name="header.trajectory_lengths")
        logprobs, entropies, linear = self.probes.per_trajectory()
        return StepResult(
            loss=tot["loss"], policy_loss=tot["policy"], kl=tot["kl"], entropy_bonus=tot["ent"], aux_loss=tot["aux"],
            expert_load=np.rint(self.load.cpu().numpy()).astype(np.int64), computed_tokens=self.computed,
            expanded_tokens=int(self.header.stats.expanded_tokens) or int(lengths.sum()),
            loss_tokens=tot["loss_tokens"], microbatches=self.n_mb, seconds=seconds, windows=self.windows,
            recomputed_microbatches=self.recomputed, stats=stats,
            logprobs=logprobs, entropies=entropies, linear_outputs=linear, standins=self.standins,
        )
