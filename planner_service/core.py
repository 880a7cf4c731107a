"""The planner service core: validation, storage, planning and slicing, with no transport.

The HTTP (`http_api.py`) and gRPC (`grpc_api.py`) adapters call the same `PlannerCore`; the
errors it raises are `planner_service.errors` types that both map through one table.

Flow of a step:
    submit(body)  -> ingest (validates, builds the Forest) -> Store.insert_step (idempotent by
                     batch_id and body hash) -> if a topology is given or configured, plan in the
                     background planning pool
    plan(step)    -> PlanConfig from the topology -> planner.plan_step -> seal one slice per rank
                     -> Store.save_plan (one transaction) -> wake long-polling fetches
    fetch(step,r) -> the stored sealed bytes, verbatim (cached in memory once read)

Blocking work (ingest, SQLite, planning) never runs on the event loop: the async methods hand it to
worker threads, and concurrent plans of one step are serialised by a per-step lock. Long-polls wait
on an event that planning sets, not on a sleep loop.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf.message import DecodeError

from planner_service import ingest
from planner_service.errors import (
    ConflictError,
    HartsError,
    LimitError,
    NotFoundError,
    NotReadyError,
    PlanningError,
    ValidationError,
)
from planner_service.forest import Forest
from planner_service.metrics import Metrics
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import CostModel
from planner_service.store import FAILED, PLANNED, SUBMITTED, StepRecord, Store
from proto.harts.v1 import plan_pb2, planner_pb2, rollouts_pb2
from proto.plan_io import seal, slice_plan

log = logging.getLogger(__name__)

__all__ = ["ServiceConfig", "PlannerCore", "topology_to_config", "MAX_WORLD_SIZE"]

MAX_WORLD_SIZE = 4096
"""Largest data-parallel world a step is planned for (one sealed slice per rank)."""


@dataclass(slots=True, kw_only=True)
class ServiceConfig:
    """Settings of one service instance."""

    db_path: str = "harts.db"
    """SQLite database file (WAL mode); ":memory:" keeps nothing across restarts."""
    token: str | None = None
    """Bearer token every non-health request must carry; None disables auth."""
    max_request_bytes: int = 256 * 1024 * 1024
    """Largest request body (HTTP) or message (gRPC) accepted; larger ones get 413 / RESOURCE_EXHAUSTED."""
    limits: Any = None
    """`planner_service.ingest.Limits` for submitted batches; None uses ingest's defaults."""
    default_topology: planner_pb2.Topology | None = None
    """Topology a submission is planned for at once when the request names none; None: wait for PlanStep."""
    conv_kernel: int = 4
    """Short-convolution kernel size K of the trainers' model (goes into every plan)."""
    default_chunk_size: int = 64
    """Chunk size used when a topology says 0."""
    list_limit: int = 100
    """ListSteps default and maximum page size."""
    max_wait_seconds: float = 60.0
    """Upper bound of a long-poll wait; longer requests are clipped."""
    plan_workers: int = 1
    """Threads that plan steps (planning is CPU-bound Numba code)."""
    cached_steps: int = 64
    """Planned steps whose sealed slices stay in memory for fast fetches."""
    cached_forests: int = 4
    """Submitted forests kept in memory so planning does not re-ingest them."""
    synchronous: str = "FULL"
    """SQLite synchronous pragma (FULL: durable across power loss; NORMAL: across process crashes)."""
    cost_model: str = ""
    """Cost model JSON (`harts calibrate`) for topologies that name none; empty: computed rows."""
    model: str = ""
    """Model config.json (JSON text) sizing the memory model for topologies that name none; empty:
    the planner's default (Qwen3-Next-80B-A3B)."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: expected >= 1024, got {self.max_request_bytes}")
        if self.token is not None and not self.token:
            raise ValueError("token: expected a non-empty string or None, got ''")
        if self.list_limit < 1:
            raise ValueError(f"list_limit: expected >= 1, got {self.list_limit}")
        if self.max_wait_seconds < 0:
            raise ValueError(f"max_wait_seconds: expected >= 0, got {self.max_wait_seconds}")
        if self.plan_workers < 1:
            raise ValueError(f"plan_workers: expected >= 1, got {self.plan_workers}")
        if self.default_topology is not None:
            topology_to_config(self.default_topology, conv_kernel=self.conv_kernel, chunk_size=self.default_chunk_size,
                               cost_model=self.cost_model, model=self.model)


def topology_to_config(
    topo: planner_pb2.Topology, *, conv_kernel: int = 4, chunk_size: int = 64, cost_model: str = "", model: str = ""
) -> PlanConfig:
    """PlanConfig of a requested topology; ValidationError names the offending `topology.<field>`.

    `cost_model` and `model` (JSON texts) apply when the topology names none."""
    if topo.world_size < 1:
        raise ValidationError("topology.world_size", f"expected >= 1, got {topo.world_size}")
    if topo.world_size > MAX_WORLD_SIZE:
        raise ValidationError("topology.world_size", f"expected <= {MAX_WORLD_SIZE}, got {topo.world_size}")
    if topo.memory_tokens < 0:
        raise ValidationError("topology.memory_tokens", f"expected >= 0 (0: default), got {topo.memory_tokens}")
    if topo.chunk_size < 0:
        raise ValidationError("topology.chunk_size", f"expected >= 0 (0: default), got {topo.chunk_size}")
    extra = {}
    for name, text in (("model", topo.model or model), ("cost_model", topo.cost_model or cost_model)):
        if not text:
            continue
        try:
            extra[name] = CostModel.from_json(text) if name == "cost_model" else json.loads(text)
        except (ValueError, TypeError) as exc:
            raise ValidationError(f"topology.{name}", f"expected a {'cost model' if name == 'cost_model' else 'config.json'} JSON document, got one that does not parse: {exc}") from None
    try:
        return PlanConfig(
            world_size=topo.world_size,
            microbatch_tokens=topo.microbatch_tokens,
            memory_tokens=topo.memory_tokens,
            chunk_size=topo.chunk_size or chunk_size,
            conv_kernel=conv_kernel,
            sharing=not topo.no_sharing,
            windows=not topo.no_windows,
            model_config=extra.get("model"),
            dtype=topo.dtype or "float32",
            **({"cost_model": extra["cost_model"]} if "cost_model" in extra else {}),
        )
    except ValueError as exc:
        name, _, msg = str(exc).partition(": ")
        if msg and name.isidentifier():
            raise ValidationError(f"topology.{name}", msg) from None
        raise ValidationError("topology", str(exc)) from None


def _normalized(cfg: PlanConfig) -> planner_pb2.Topology:
    """The topology as planned: defaults resolved, so equal requests compare equal."""
    return planner_pb2.Topology(
        world_size=cfg.world_size,
        microbatch_tokens=cfg.microbatch_tokens,
        memory_tokens=cfg.memory_tokens,
        chunk_size=cfg.chunk_size,
        no_sharing=not cfg.sharing,
        no_windows=not cfg.windows,
        model=json.dumps(cfg.model_config, sort_keys=True) if cfg.model_config is not None else "",
        dtype=cfg.dtype,
        cost_model=cfg.cost_model.to_json() if cfg.cost_model != CostModel() else "",
    )


class PlannerCore:
    """Transport-free service: thread-safe sync methods plus async wrappers for the event loop.

    Args:
        cfg: service settings.
        metrics: where to record; a fresh registry by default.
    """

    def __init__(self, cfg: ServiceConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.store = Store(cfg.db_path, synchronous=cfg.synchronous)
        self.metrics.steps_waiting.set_function(self.store.count_unplanned)
        self._plan_pool = ThreadPoolExecutor(max_workers=cfg.plan_workers, thread_name_prefix="harts-plan")
        self._guard = threading.Lock()
        self._step_locks: dict[str, threading.Lock] = {}
        self._slices: OrderedDict[str, list[bytes]] = OrderedDict()
        self._forests: OrderedDict[str, Forest] = OrderedDict()
        self._listeners: dict[str, set[Callable[[], None]]] = {}
        self.ready = False

    # ---- lifecycle

    def start(self) -> None:
        """Compile the Numba code (ingest and planner) and resume interrupted plans; sets `ready`."""
        t0 = time.perf_counter()
        ingest.warmup()
        _planner().warmup()
        log.info("numba code compiled in %.2f s", time.perf_counter() - t0)
        for rec in self.store.pending():
            topo = planner_pb2.Topology.FromString(rec.topology)
            log.info("resuming the interrupted plan of step %s", rec.step_id)
            self._plan_pool.submit(self._plan_background, rec.step_id, topo)
        self.ready = True

    def close(self) -> None:
        self.ready = False
        self._plan_pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    # ---- submit

    def submit(self, body: bytes, fmt: str, topology: planner_pb2.Topology | None = None) -> planner_pb2.SubmitRolloutsResponse:
        """Validate and store a step's rollouts; plan them in the background if a topology applies.

        Idempotency compares bodies: a JSON document byte for byte, a protobuf batch by its
        deterministic serialisation; the same batch_id with another body is a conflict.

        Args:
            body: the JSON document (fmt "json") or RolloutBatch bytes (fmt "proto").
            topology: plan for this topology at once (else the configured default, if any).

        Raises:
            ValidationError / LimitError: the batch is invalid or too large (nothing is stored).
            ConflictError: the batch_id is stored with a different body.
        """
        if len(body) > self.cfg.max_request_bytes:
            raise _too_large(len(body), self.cfg.max_request_bytes)
        if fmt == "json":
            forest = ingest.forest_from_json(body, self.cfg.limits)
            stored = body
        elif fmt == "proto":
            batch = rollouts_pb2.RolloutBatch()
            try:
                batch.ParseFromString(body)
            except DecodeError:
                raise ValidationError("body", "expected a serialised harts.v1.RolloutBatch, got bytes that do not parse") from None
            return self.submit_message(batch, topology, nbytes=len(body))
        else:
            raise ValueError(f"fmt: expected 'json' or 'proto', got {fmt!r}")
        return self._store_forest(forest, fmt, stored, topology)

    def submit_message(
        self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None, *, nbytes: int | None = None
    ) -> planner_pb2.SubmitRolloutsResponse:
        """`submit` for an already parsed RolloutBatch (gRPC); stores its deterministic serialisation."""
        canonical = batch.SerializeToString(deterministic=True)
        if len(canonical) > self.cfg.max_request_bytes:
            raise _too_large(len(canonical), self.cfg.max_request_bytes)
        forest = ingest.forest_from_proto(batch, self.cfg.limits)
        return self._store_forest(forest, "proto", canonical, topology, nbytes=nbytes)

    def _store_forest(
        self, forest: Forest, fmt: str, body: bytes, topology: planner_pb2.Topology | None, *, nbytes: int | None = None
    ) -> planner_pb2.SubmitRolloutsResponse:
        if topology is not None and topology.ByteSize() == 0:
            topology = None
        topology = topology if topology is not None else self.cfg.default_topology
        topo_cfg = None
        if topology is not None:
            topo_cfg = self._config(topology)
        digest = hashlib.sha256(body).hexdigest()
        rec = StepRecord(
            step_id=forest.batch_id,
            body_sha256=f"{fmt}:{digest}",
            body_format=fmt,
            trajectories=forest.num_trajectories,
            unique_tokens=forest.unique_tokens,
            expanded_tokens=forest.expanded_tokens,
            submitted_at=time.time(),
            state=SUBMITTED,
            topology=_normalized(topo_cfg).SerializeToString(deterministic=True) if topo_cfg else None,
        )
        rec, duplicate = self.store.insert_step(rec, body)
        self.metrics.submissions.labels("duplicate" if duplicate else "new").inc()
        if not duplicate:
            self.metrics.ingest_bytes.labels(fmt).inc(nbytes if nbytes is not None else len(body))
            with self._guard:
                self._forests[rec.step_id] = forest
                while len(self._forests) > self.cfg.cached_forests:
                    self._forests.popitem(last=False)
            if topo_cfg is not None:
                self._plan_pool.submit(self._plan_background, rec.step_id, _normalized(topo_cfg))
            self._notify(rec.step_id)
        elif topo_cfg is not None and rec.state == SUBMITTED and rec.topology is None:
            self.store.request_plan(rec.step_id, _normalized(topo_cfg).SerializeToString(deterministic=True))
            self._plan_pool.submit(self._plan_background, rec.step_id, _normalized(topo_cfg))
        return planner_pb2.SubmitRolloutsResponse(status=self._status(rec), duplicate=duplicate)

    # ---- plan

    def _config(self, topology: planner_pb2.Topology) -> PlanConfig:
        return topology_to_config(topology, conv_kernel=self.cfg.conv_kernel, chunk_size=self.cfg.default_chunk_size,
                                  cost_model=self.cfg.cost_model, model=self.cfg.model)

    def _step_lock(self, step_id: str) -> threading.Lock:
        with self._guard:
            return self._step_locks.setdefault(step_id, threading.Lock())

    def _forest(self, step_id: str) -> Forest:
        with self._guard:
            forest = self._forests.get(step_id)
        if forest is not None:
            return forest
        fmt, body = self.store.body(step_id)
        forest = ingest.forest_from_json(body) if fmt == "json" else ingest.forest_from_proto(body)
        with self._guard:
            self._forests[step_id] = forest
            while len(self._forests) > self.cfg.cached_forests:
                self._forests.popitem(last=False)
        return forest

    def plan(self, step_id: str, topology: planner_pb2.Topology) -> planner_pb2.StepStatus:
        """Plan a stored step for a topology and store its sealed slices.

        Idempotent: a step already planned for the same (normalised) topology returns its status;
        a planned step is never re-planned for another topology (its slices may be in use), and
        a step whose planning failed can be planned again.

        Raises:
            NotFoundError: unknown step. ValidationError: bad topology.
            ConflictError: planned for another topology. PlanningError: the planner cannot satisfy it.
        """
        cfg = self._config(topology)
        want = _normalized(cfg).SerializeToString(deterministic=True)
        with self._step_lock(step_id):
            rec = self.store.get(step_id)
            if rec.state == PLANNED:
                if rec.topology == want:
                    return self._status(rec)
                raise ConflictError(
                    f"topology: step {step_id!r} is already planned for another topology; submit the "
                    "rollouts under a new batch_id to plan them differently"
                )
            self.store.request_plan(step_id, want)
            forest = self._forest(step_id)
            t0 = time.perf_counter()
            try:
                plan = _planner().plan_step(forest, cfg)
            except (PlanningError, ValueError) as exc:
                msg = exc.message if isinstance(exc, HartsError) else str(exc)
                self.store.save_failure(step_id, topology=want, error=msg)
                self.metrics.plans.labels("failed").inc()
                self._notify(step_id)
                raise PlanningError(msg) from None
            except Exception:
                log.exception("planning step %s failed", step_id)
                self.store.save_failure(step_id, topology=want, error="internal error while planning")
                self.metrics.plans.labels("failed").inc()
                self._notify(step_id)
                raise
            seconds = time.perf_counter() - t0
            slices = self._seal_all(plan, cfg.world_size)
            self.store.save_plan(step_id, topology=want, stats=plan.header.stats.SerializeToString(deterministic=True), slices=slices)
            self._cache_slices(step_id, slices)
            st = plan.header.stats
            self.metrics.plans.labels("planned").inc()
            self.metrics.plan_seconds.observe(seconds)
            self.metrics.compression_ideal.observe(st.compression_ideal)
            self.metrics.compression_achieved.observe(st.compression_achieved)
            log.info("planned step %s: %d microbatches, compression %.2fx achieved / %.2fx ideal, %.3f s",
                     step_id, st.microbatches, st.compression_achieved, st.compression_ideal, seconds)
            rec = self.store.get(step_id)
        self._notify(step_id)
        return self._status(rec)

    @staticmethod
    def _seal_all(plan: plan_pb2.Plan, world_size: int) -> list[bytes]:
        if len(plan.ranks) != world_size:
            raise AssertionError(f"planner returned {len(plan.ranks)} ranks for world_size {world_size}")
        return [seal(slice_plan(plan, r)) for r in range(world_size)]

    def _plan_background(self, step_id: str, topology: planner_pb2.Topology) -> None:
        try:
            self.plan(step_id, topology)
        except HartsError as exc:
            log.warning("step %s not planned: %s", step_id, exc.message)
        except Exception:  # already logged with its traceback by plan()
            pass

    # ---- fetch

    def _cache_slices(self, step_id: str, slices: list[bytes]) -> None:
        with self._guard:
            self._slices[step_id] = slices
            self._slices.move_to_end(step_id)
            while len(self._slices) > self.cfg.cached_steps:
                self._slices.popitem(last=False)

    def _cached(self, step_id: str, rank: int) -> bytes | None:
        with self._guard:
            slices = self._slices.get(step_id)
        if slices is not None and 0 <= rank < len(slices):
            return slices[rank]
        return None

    def fetch(self, step_id: str, rank: int) -> bytes:
        """Sealed slice bytes of one rank (identical on every call).

        Raises:
            NotFoundError: unknown step or rank outside the topology. NotReadyError: not planned yet.
            PlanningError: planning failed (the status says why).
        """
        if rank < 0:
            raise ValidationError("rank", f"expected >= 0, got {rank}")
        hit = self._cached(step_id, rank)
        if hit is not None:
            return hit
        rec = self.store.get(step_id)
        if rec.state == FAILED:
            raise PlanningError(f"step {step_id!r} could not be planned: {rec.error}")
        if rec.state != PLANNED:
            raise NotReadyError(f"step {step_id!r} is not planned yet; retry, or long-poll with a wait")
        if rank >= rec.world_size:
            raise NotFoundError(f"rank: expected 0 <= rank < {rec.world_size} (the step's world_size), got {rank}")
        slices = [self.store.slice(step_id, r) for r in range(rec.world_size)]
        if any(s is None for s in slices):
            raise AssertionError(f"step {step_id} is PLANNED but misses slices")
        self._cache_slices(step_id, slices)
        return slices[rank]

    async def fetch_async(self, step_id: str, rank: int, wait: float = 0.0) -> bytes:
        """`fetch` with long-poll: wait up to `wait` seconds (clipped to max_wait_seconds) for the
        step to be submitted and planned. Raises fetch's errors when the wait runs out."""
        hit = self._cached(step_id, rank)
        if hit is not None:
            return hit
        wait = min(max(float(wait), 0.0), self.cfg.max_wait_seconds)
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(event.set)

        deadline = loop.time() + wait
        self._listen(step_id, wake)  # before the first look, so no settle slips between
        try:
            while True:
                event.clear()
                try:
                    return await asyncio.to_thread(self.fetch, step_id, rank)
                except (NotReadyError, NotFoundError) as exc:
                    if isinstance(exc, NotFoundError) and exc.message.startswith("rank:"):
                        raise
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise
                self.metrics.fetch_waiters.inc()
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    pass
                finally:
                    self.metrics.fetch_waiters.dec()
        finally:
            self._unlisten(step_id, wake)

    def _listen(self, step_id: str, fn: Callable[[], None]) -> None:
        with self._guard:
            self._listeners.setdefault(step_id, set()).add(fn)

    def _unlisten(self, step_id: str, fn: Callable[[], None]) -> None:
        with self._guard:
            fns = self._listeners.get(step_id)
            if fns is not None:
                fns.discard(fn)
                if not fns:
                    del self._listeners[step_id]

    def _notify(self, step_id: str) -> None:
        with self._guard:
            fns = list(self._listeners.get(step_id, ()))
        for fn in fns:
            fn()

    # ---- status

    def _status(self, rec: StepRecord) -> planner_pb2.StepStatus:
        st = planner_pb2.StepStatus(
            step_id=rec.step_id,
            state=rec.state,
            trajectories=rec.trajectories,
            unique_tokens=rec.unique_tokens,
            expanded_tokens=rec.expanded_tokens,
            error=rec.error,
            submitted_at=rec.submitted_at,
            planned_at=rec.planned_at,
        )
        if rec.stats:
            st.stats.ParseFromString(rec.stats)
        if rec.topology:
            st.topology.ParseFromString(rec.topology)
        return st

    def status(self, step_id: str) -> planner_pb2.StepStatus:
        return self._status(self.store.get(step_id))

    def list_steps(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        """At most `limit` steps (0: the configured default; clipped to it), newest first."""
        if limit < 0:
            raise ValidationError("limit", f"expected >= 0, got {limit}")
        limit = min(limit or self.cfg.list_limit, self.cfg.list_limit)
        return [self._status(r) for r in self.store.list(limit)]

    # ---- async wrappers (run the blocking work off the event loop)

    async def submit_async(self, body: bytes, fmt: str, topology: planner_pb2.Topology | None = None):
        return await asyncio.to_thread(self.submit, body, fmt, topology)

    async def submit_message_async(self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None):
        return await asyncio.to_thread(self.submit_message, batch, topology)

    async def plan_async(self, step_id: str, topology: planner_pb2.Topology) -> planner_pb2.StepStatus:
        return await asyncio.get_running_loop().run_in_executor(self._plan_pool, self.plan, step_id, topology)

    async def status_async(self, step_id: str) -> planner_pb2.StepStatus:
        return await asyncio.to_thread(self.status, step_id)

    async def list_steps_async(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        return await asyncio.to_thread(self.list_steps, limit)


def _too_large(size: int, limit: int) -> LimitError:
    """The error of a request body over the configured size."""
    return LimitError(f"request: expected at most {limit} bytes, got {size}")


def _planner():
    # Imported on use: the planner package pulls in its Numba modules.
    import planner_service.planner as planner

    return planner
