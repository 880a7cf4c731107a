"""What the sections share: the device, the seeded weights, the batches and their plans, made once.

    ctx = BenchContext(settings)
    model = ctx.model(torch.bfloat16, trains=True)   # the seeded weights; a later ctx.model(...) rebuilds them
    plan = ctx.plan("tree", "windows")               # the whole batch, windows (tree) plan
    plan = ctx.plan("tree", "expanded", tokens=32768) # a seeded subset, trajectory-expanded

The model is built once on the device and copied to the host, every later model materialised
from that copy; batches from `harts gen`'s generator, planned here by the planner's plain-Python
functions (benchmarks/README.md, "How the sections run").
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, fields

import torch

from benchmarks.bench_trainer import subset_trajectories
from benchmarks.gpu.settings import BenchSettings, Workload
from harts_client.synthetic import generate
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from trainer.executor import ExecutorConfig
from trainer.flops import plan_flops
from trainer.models import build_model, materialize, meta_model, model_config

log = logging.getLogger("bench_gpu")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class _Batch:
    workload: Workload
    doc: dict
    forest: object
    subsets: dict = field(default_factory=dict)
    """max tokens -> (subset doc, its forest)."""


class BenchContext:
    """Device, weights, batches and plans of one benchmark run (benchmarks/README.md, "How the sections run")."""

    def __init__(self, settings: BenchSettings):
        self.s = settings
        self.device = torch.device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.model_config = model_config(settings.model)
        self.results: dict[str, dict] = {}
        """Finished sections' data by name (the MFU denominator, our rates for the peer's ratio)."""
        self.build_seconds: float | None = None
        self._reference: dict[str, torch.Tensor] | None = None
        self._models: dict[torch.dtype, object] = {}
        self._trained: set[torch.dtype] = set()
        self._batches: dict[str, _Batch] = {}
        self._plans: dict[tuple, object] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        """Allocated and peak-allocated bytes since the last reset (None on the CPU)."""
        if not self.cuda:
            return {"allocated_bytes": None, "peak_allocated_bytes": None}
        return {"allocated_bytes": torch.cuda.memory_allocated(), "peak_allocated_bytes": torch.cuda.max_memory_allocated()}

    def model(self, dtype: torch.dtype, *, trains: bool = False):
        """The seeded model in `dtype` on the device (cached per dtype).

        Args:
            trains: the caller steps an optimizer on it; the next call rebuilds the seeded weights.
        """
        if dtype in self._trained:
            self._models.pop(dtype, None)
            self._trained.discard(dtype)
        if dtype not in self._models:
            t0 = time.perf_counter()
            if self._reference is None:
                model = build_model(self.s.model, seed=0, device=self.device)
                self.sync()
                self.build_seconds = time.perf_counter() - t0
                self._reference = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
                log.info("built %s on %s in %.1f s: %.3fB parameters", self.s.model, self.device, self.build_seconds,
                         self.num_parameters / 1e9)
            else:
                ref = self._reference
                model = materialize(meta_model(self.model_config), self.device, lambda name, shape, rows: ref[name][rows])
            self._models[dtype] = model.to(dtype)
            self.sync()
            log.info("model in %s ready in %.1f s", str(dtype).removeprefix("torch."), time.perf_counter() - t0)
        if trains:
            self._trained.add(dtype)
        return self._models[dtype]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in meta_model(self.model_config).parameters())

    def release_models(self) -> None:
        """Drop every cached model (the seeded host copy stays) and free their memory now."""
        self._models.clear()
        self._trained.clear()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reference_state(self) -> dict[str, torch.Tensor]:
        """The seeded fp32 weights on the host (builds the model first if no section has)."""
        if self._reference is None:
            self.model(self.dtype)
        return self._reference

    def executor_config(self, **overrides):
        """ExecutorConfig of this run: C, the GDN backend, then `overrides` (fields it lacks are refused)."""
        return ExecutorConfig(chunk_size=self.s.chunk_size, backend=self.s.backend, **overrides)

    def batch(self, name: str) -> _Batch:
        """The workload's batch: the generator's document and its prefix forest (made once)."""
        if name not in self._batches:
            w = next(w for w in self.s.workloads if w.name == name)
            t0 = time.perf_counter()
            doc = generate(**w.generator_kwargs(self.model_config.vocab_size))
            self._batches[name] = _Batch(workload=w, doc=doc, forest=forest_from_json(doc, numba=False))
            f = self._batches[name].forest
            log.info("%s: %d trajectories, %d expanded / %d distinct tokens (generated in %.1f s)", name,
                     f.num_trajectories, f.expanded_tokens, f.unique_tokens, time.perf_counter() - t0)
        return self._batches[name]

    def subset(self, name: str, tokens: int | None) -> tuple[dict, object]:
        """(document, forest) of a seeded subset of about `tokens` expanded tokens (None: the batch)."""
        b = self.batch(name)
        if tokens is None:
            return b.doc, b.forest
        if tokens not in b.subsets:
            doc = subset_trajectories(b.doc, tokens, seed=self.s.subset_seed)
            b.subsets[tokens] = (doc, b.forest if doc is b.doc else forest_from_json(doc, numba=False))
        return b.subsets[tokens]

    def plan(self, name: str, kind: str, *, tokens: int | None = None, microbatch_tokens: int | None = None):
        """The plan of workload `name` (made once).

        Args:
            kind: "windows" (the tree plan with sharing windows) or "expanded" (PlanConfig(sharing=False)).
            tokens: plan a seeded subset of about this many expanded tokens (None: the batch).
            microbatch_tokens: B (default the settings').
        """
        if kind not in ("windows", "expanded"):
            raise ValueError(f"kind: expected 'windows' or 'expanded', got {kind!r}")
        B = microbatch_tokens or self.s.microbatch_tokens
        key = (name, kind, tokens, B)
        if key not in self._plans:
            _, forest = self.subset(name, tokens)
            cfg = PlanConfig(microbatch_tokens=B, chunk_size=self.s.chunk_size, model_config=self.model_config.to_hf_dict(),
                             dtype=self.s.dtype, sharing=kind == "windows")
            t0 = time.perf_counter()
            self._plans[key] = plan_step(forest, cfg, impl="ref")
            st = self._plans[key].header.stats
            log.info("planned %s %s (tokens %s, B %d) in %.1f s: %d microbatches, %d windows", name, kind, tokens, B,
                     time.perf_counter() - t0, st.microbatches, st.windows)
        return self._plans[key]

    def flops(self, plan) -> float:
        """Model FLOPs of one training step of `plan`: 3 x `trainer.flops` (forward + backward)."""
        return 3.0 * plan_flops(plan, self.model_config, chunk_size=self.s.chunk_size).total


def plan_summary(plan) -> dict:
    """The plan statistics a result row carries."""
    st = plan.header.stats
    return {"expanded_tokens": int(st.expanded_tokens), "unique_tokens": int(st.unique_tokens),
            "microbatches": int(st.microbatches), "windows": int(st.windows),
            "compression_ideal": float(st.compression_ideal), "compression_achieved": float(st.compression_achieved),
            "recomputed": sum(mb.recompute for r in plan.ranks for mb in r.microbatches)}


def config_dict(cfg) -> dict:
    """A dataclass config as plain JSON values (dtypes and nested configs as strings)."""
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
    return out
