"""The planner service core: validation, storage, planning and slicing, with no transport.

The HTTP (`http_api.py`) and gRPC (`grpc_api.py`) adapters call the same `PlannerCore`; the
errors it raises are `planner_service.errors` types that both map through one table.

Flow of a step:
    submit(body)  -> ingest (validates, builds the Forest) -> Store.insert_step (idempotent by
                     batch_id and the batch's content digest) -> if a topology is given or
                     configured, plan in the background planning pool
    plan(step)    -> PlanConfig from the topology -> planner.plan_step -> seal one slice per rank
                     -> Store.save_plan (one transaction) -> wake long-polling fetches
    fetch(step,r) -> the stored sealed bytes, exactly (restored from their compressed stored form,
                     cached in memory once read)
    delete(step)  -> the step, its body and its slices leave the database and the caches

Blocking work (ingest, SQLite, planning) never runs on the event loop: the async methods hand it to
three pools of worker threads that cannot hold each other up (planning; reads: status, list,
slices; submissions and deletions), and concurrent plans of one step are serialised by a per-step
lock. Long-polls wait on an event that planning sets, not on a sleep loop.

Storage faults (`store.py`): the service is not ready while the database cannot be written, every
request that needs a write answers StorageError (503) naming the reason, and a plan that could not
be stored shows its step as failed with that error. The maintenance thread (`maintenance.py`)
probes the database; when it is writable again, readiness comes back and interrupted or
failed-to-store plans run again. The same thread applies the retention policy (`retain_steps`,
`max_age_seconds`) and compacts the database after deletions.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from google.protobuf.message import DecodeError

from planner_service import ingest
from planner_service.cache import ByteLRU
from planner_service.digest import DIGEST_VERSION, forest_digest
from planner_service.errors import (
    ConflictError,
    HartsError,
    IntegrityError,
    LimitError,
    NotFoundError,
    NotReadyError,
    PlanningError,
    StorageError,
    Unavailable,
    ValidationError,
)
from planner_service.forest import Forest
from planner_service.maintenance import Maintenance
from planner_service.metrics import Metrics
from planner_service.planner.config import PlanConfig
from planner_service.wire_errors import wire_error
from planner_service.service_config import (
    DEFAULT_MICROBATCH_TOKENS,
    MAX_WORLD_SIZE,
    ServiceConfig,
    check_step_id,
    normalized_topology,
    topology_to_config,
)
from planner_service.store import FAILED, PLANNED, SUBMITTED, StepRecord, open_store
from proto.harts.v1 import plan_pb2, planner_pb2, rollouts_pb2
from plan.seal import seal, slice_plan

log = logging.getLogger(__name__)

_SHARED_POLL_S = 2.0
"""Longest wait of a long-poll between two looks at a shared (PostgreSQL) store."""

_READ_WORKERS = 4
"""Threads of the read pool (status, list, plan slices); submissions and deletions run in the
event loop's default pool, plans in the planning pool."""

__all__ = ["ServiceConfig", "PlannerCore", "topology_to_config", "MAX_WORLD_SIZE", "DEFAULT_MICROBATCH_TOKENS"]

def _forest_bytes(forest: Forest) -> int:
    """Approximate memory of a forest: its arrays plus its id strings."""
    total = 0
    for name in Forest.__slots__:
        value = getattr(forest, name)
        if hasattr(value, "nbytes"):
            total += int(value.nbytes)
        elif isinstance(value, list):
            total += sum(56 + len(s) for s in value)
    return total


class PlannerCore:
    """Transport-free service: thread-safe sync methods plus async wrappers for the event loop.

    Args:
        cfg: service settings.
        metrics: where to record; a fresh registry by default.
    """

    def __init__(self, cfg: ServiceConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self._guard = threading.Lock()
        self._step_locks: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # (step, rank) -> sealed bytes: a miss reads (and decompresses) that rank's slice only
        self._slices: ByteLRU[tuple[str, int], bytes] = ByteLRU(
            cfg.slice_cache_bytes, len, self.metrics.cache_bytes.labels("slices").set)
        self._forests: ByteLRU[tuple[str, str], Forest] = ByteLRU(
            cfg.forest_cache_bytes, _forest_bytes, self.metrics.cache_bytes.labels("forests").set)
        self._listeners: dict[str, set[Callable[[], None]]] = {}
        self._readiness_listeners: list[Callable[[bool, str], None]] = []
        # plans whose outcome could not be stored (storage fault): step -> (error, topology, bytes
        # the plan needs on the disk, 0 when another fault stopped it)
        self._unstored: dict[str, tuple[str, planner_pb2.Topology, int]] = {}
        # steps handed to the planning pool and not finished: resuming skips them
        self._queued: set[str] = set()
        self._started = False
        self._closing = False
        self._fault_logged = 0.0
        self.store = open_store(cfg.db_path, synchronous=cfg.synchronous, min_free_bytes=cfg.min_free_bytes,
                                on_fault=self._storage_changed, accept_data_loss=cfg.accept_data_loss)
        self._storage_healthy = self.store.fault is None
        self.metrics.storage_ok.set(0 if self.store.fault else 1)
        self.metrics.steps_waiting.set_function(self._count_unplanned)
        self._plan_pool = ThreadPoolExecutor(max_workers=cfg.plan_workers, thread_name_prefix="harts-plan")
        # reads (status, list, slices) have threads of their own: plans and submissions, however
        # many or slow, never hold up a GET (six slow submissions once filled the shared pool)
        self._read_pool = ThreadPoolExecutor(max_workers=_READ_WORKERS, thread_name_prefix="harts-read")
        self._maintenance = Maintenance(
            self.store, probe_seconds=cfg.storage_probe_seconds, retain_steps=cfg.retain_steps,
            max_age_seconds=cfg.max_age_seconds, resume=self.resume_pending,
            resume_every=cfg.resume_seconds if self.store.shared else 0.0,
            delete=lambda step_id: self.delete(step_id, cause="retention"))

    # ---- lifecycle and readiness

    def start(self) -> None:
        """Compile the Numba code (ingest and planner), VACUUM if configured, check that the
        database can be written and resume interrupted plans; then start the maintenance thread.
        Ready once started and healthy."""
        t0 = time.perf_counter()
        ingest.warmup()
        _planner().warmup()
        log.info("numba code compiled in %.2f s", time.perf_counter() - t0)
        if self.cfg.vacuum:
            try:
                self.store.compact(vacuum=True)
            except StorageError:
                pass  # the store is faulted: the probe below reports it
        fault = self.store.probe()
        if fault is None:
            self.resume_pending()
        elif time.monotonic() - self._fault_logged > 1.0:  # not just logged by _storage_changed
            log.warning("storage fault, not ready until it clears: %s", fault)
        self.store.listen(self._step_changed)
        self.store.watch_files()
        self._started = True
        self._maintenance.start(resume=fault is not None)
        self._readiness_changed()

    @property
    def ready(self) -> bool:
        """Started, not stopping, and the database writable."""
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): the reason names what keeps the service from being ready ("" when ready)."""
        if self._closing:
            return False, "stopping"
        if not self._started:
            return False, "starting: compiling the Numba code and resuming interrupted plans"
        fault = self.store.fault
        return (False, fault) if fault else (True, "")

    def on_readiness(self, fn: Callable[[bool, str], None]) -> None:
        """Call `fn(ready, reason)` now and on every change (from any thread; it must not block)."""
        self._readiness_listeners.append(fn)
        fn(*self.readiness())

    def _readiness_changed(self) -> None:
        state = self.readiness()
        for fn in list(self._readiness_listeners):
            fn(*state)

    def stop_serving(self) -> None:
        """Report not ready from now on (the transports drain) and answer waiting long-polls at
        once (503: they retry, on another replica if they know one); `close` releases everything."""
        self._closing = True
        self._readiness_changed()
        with self._guard:
            waiting = [fn for fns in self._listeners.values() for fn in fns]
        for fn in waiting:
            fn()

    def close(self) -> None:
        self.stop_serving()
        self._maintenance.stop()
        self._plan_pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def _storage_changed(self, reason: str | None) -> None:
        # called by the store with its lock held: only record, log and wake
        if reason is None:
            log.info("storage recovered: %s can be written again; resuming plans", self.store.path)
            self.metrics.storage_ok.set(1)
            self._maintenance.wake(resume=True)
        else:
            # one line when the fault starts; a changed reason at most once a minute after that
            now = time.monotonic()
            if self._storage_healthy or now - self._fault_logged > 60:
                log.warning("storage fault, not ready until it clears: %s", reason)
                self._fault_logged = now
            if self._storage_healthy:
                self.metrics.storage_faults.inc()
                self._maintenance.wake()  # probe every second from now on
            self.metrics.storage_ok.set(0)
        self._storage_healthy = reason is None
        self._readiness_changed()

    def _count_unplanned(self) -> float:
        try:
            return float(self.store.count_unplanned())
        except StorageError:
            return math.nan

    def resume_pending(self) -> None:
        """Plan again every step whose planning was interrupted (here, or on a replica that died:
        one whose planning lock nobody holds) or could not be stored; a plan that did not fit on
        the disk waits until it does."""
        todo: dict[str, planner_pb2.Topology] = {}
        for rec in self.store.pending():
            todo[rec.step_id] = planner_pb2.Topology.FromString(rec.topology)
        free = self.store.free_bytes()
        with self._guard:
            for step_id, (_, topo, need) in self._unstored.items():
                if need and free is not None and free - need < self.store.min_free_bytes:
                    todo.pop(step_id, None)
                    continue
                todo.setdefault(step_id, topo)
        for step_id, topo in todo.items():
            if self._queue_plan(step_id, topo, resumed=True):
                log.info("resuming the plan of step %s", step_id)

    def _queue_plan(self, step_id: str, topology: planner_pb2.Topology, *, resumed: bool = False) -> bool:
        """Hand a step to the planning pool unless it is there already. Returns whether it was queued."""
        with self._guard:
            if step_id in self._queued or self._closing:
                return False
            self._queued.add(step_id)
        try:
            self._plan_pool.submit(self._plan_background, step_id, topology, resumed)
        except RuntimeError:  # the pool shut down meanwhile
            with self._guard:
                self._queued.discard(step_id)
            return False
        return True

    def _step_changed(self, event: str, step_id: str) -> None:
        """A replica (maybe this one) committed `event` for a step: wake its long-polls; a deleted
        step leaves the caches. After a reconnect of the listener every waiter looks again."""
        if event == "deleted":
            self._slices.pop_where(lambda key: key[0] == step_id)
            self._forests.pop_where(lambda key: key[0] == step_id)
        if event == "reconnected":
            with self._guard:
                waiting = [fn for fns in self._listeners.values() for fn in fns]
            for fn in waiting:
                fn()
            return
        self._notify(step_id)

    # ---- submit

    def _body_limit(self) -> int:
        limit = self.cfg.max_request_bytes
        if self.cfg.limits is not None:
            limit = min(limit, self.cfg.limits.max_body_bytes)
        return limit

    def submit(self, body: bytes | bytearray, fmt: str, topology: planner_pb2.Topology | None = None, *,
               body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        """Validate and store a step's rollouts; plan them in the background if a topology applies.

        Idempotency compares content: the same batch_id with the same content (however it was
        serialised: JSON spelling, key order, or protobuf) is a duplicate; with other content it
        is a conflict. The response's `body_sha256` is the SHA-256 of `body`, which is stored as
        it came.

        Args:
            body: the JSON document (fmt "json") or RolloutBatch bytes (fmt "proto").
            topology: plan for this topology at once (else the configured default, if any).
            body_sha256: the hex SHA-256 the client computed over `body` ("": not checked).

        Raises:
            IntegrityError: `body` is not what the client digested (nothing is stored).
            ValidationError / LimitError: the batch is invalid or too large (nothing is stored).
            ConflictError: the batch_id is stored with other content.
            StorageError: the database cannot be written (nothing is stored).
        """
        limit = self._body_limit()
        if len(body) > limit:
            raise _too_large(len(body), limit)
        digest = _body_digest(body, body_sha256)
        if fmt == "json":
            forest = ingest.forest_from_json(body, self.cfg.limits)
        elif fmt == "proto":
            batch = rollouts_pb2.RolloutBatch()
            try:
                batch.ParseFromString(body)  # bytes or bytearray, without a copy
            except DecodeError:
                raise wire_error(rollouts_pb2.RolloutBatch, body, "body") from None
            forest = ingest.forest_from_proto(batch, self.cfg.limits)
            del batch
        else:
            raise ValueError(f"fmt: expected 'json' or 'proto', got {fmt!r}")
        return self._store_forest(forest, fmt, body, digest, topology)

    def submit_message(self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None, *,
                       body: bytes | None = None, body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        """`submit` for an already parsed RolloutBatch (gRPC).

        Args:
            body: the batch's bytes as they arrived (stored and digested as they are); None: its
                serialisation.
            body_sha256: as in `submit`, over `body`.
        """
        if body is None:
            body = batch.SerializeToString()
        limit = self._body_limit()
        if len(body) > limit:
            raise _too_large(len(body), limit)
        digest = _body_digest(body, body_sha256)
        forest = ingest.forest_from_proto(batch, self.cfg.limits)
        return self._store_forest(forest, "proto", body, digest, topology)

    def _store_forest(self, forest: Forest, fmt: str, body: bytes | bytearray, body_sha256: str,
                      topology: planner_pb2.Topology | None) -> planner_pb2.SubmitRolloutsResponse:
        check_step_id(forest.batch_id, "batch_id")
        if topology is not None and topology.ByteSize() == 0:
            topology = None
        topology = topology if topology is not None else self.cfg.default_topology
        topo_cfg = None
        if topology is not None:
            topo_cfg = self._config(topology)
        digest = forest_digest(forest)
        rec = StepRecord(
            step_id=forest.batch_id,
            body_sha256=digest,
            body_format=fmt,
            trajectories=forest.num_trajectories,
            unique_tokens=forest.unique_tokens,
            expanded_tokens=forest.expanded_tokens,
            submitted_at=time.time(),
            state=SUBMITTED,
            topology=normalized_topology(topo_cfg).SerializeToString(deterministic=True) if topo_cfg else None,
        )
        old = self.store.insert_step(rec, body)
        duplicate = old is not None
        if duplicate:
            if not self._same_content(old, digest):
                raise ConflictError(
                    f"batch_id: {rec.step_id!r} is already stored with other content; "
                    "use a new batch_id for new rollouts"
                )
            rec = old
        self.metrics.submissions.labels("duplicate" if duplicate else "new").inc()
        if not duplicate:
            self.metrics.ingest_bytes.labels(fmt).inc(len(body))
            self._forests.put((rec.step_id, digest), forest)
            if topo_cfg is not None:
                self._queue_plan(rec.step_id, normalized_topology(topo_cfg))
            self._notify(rec.step_id)
            if self.cfg.retain_steps:
                self._maintenance.wake()
        elif topo_cfg is not None and rec.state == SUBMITTED and rec.topology is None:
            self.store.request_plan(rec.step_id, normalized_topology(topo_cfg).SerializeToString(deterministic=True))
            self._queue_plan(rec.step_id, normalized_topology(topo_cfg))
        return planner_pb2.SubmitRolloutsResponse(status=self._status(rec), duplicate=duplicate, body_sha256=body_sha256)

    def _same_content(self, old: StepRecord, digest: str) -> bool:
        if old.body_sha256 == digest:
            return True
        if not old.body_sha256.startswith(DIGEST_VERSION + ":"):
            # a row of an earlier version (keyed by its body bytes, or by a digest that left out
            # some fields): digest what it stored
            return forest_digest(self._forest(old.step_id, old.body_sha256)) == digest
        return False

    # ---- plan

    def _config(self, topology: planner_pb2.Topology) -> PlanConfig:
        return topology_to_config(topology, conv_kernel=self.cfg.conv_kernel, chunk_size=self.cfg.default_chunk_size,
                                  microbatch_tokens=self.cfg.default_microbatch_tokens, cost_model=self.cfg.cost_model,
                                  model=self.cfg.model)

    def _step_lock(self, step_id: str) -> threading.Lock:
        with self._guard:
            lock = self._step_locks.get(step_id)
            if lock is None:
                lock = self._step_locks[step_id] = threading.Lock()
            return lock

    def _forest(self, step_id: str, digest: str) -> Forest:
        """The forest of a stored step, keyed by its content digest too (a step deleted and
        submitted again, maybe on another replica, never finds the old forest)."""
        forest = self._forests.get((step_id, digest))
        if forest is not None:
            return forest
        fmt, body = self.store.body(step_id)
        if fmt == "json":
            forest = ingest.forest_from_json(body, self.cfg.limits)
        else:
            forest = ingest.forest_from_proto(body, self.cfg.limits)
        self._forests.put((step_id, digest), forest)
        return forest

    def plan(self, step_id: str, topology: planner_pb2.Topology, *, resumed: bool = False) -> planner_pb2.StepStatus:
        """Plan a stored step for a topology and store its sealed slices.

        Idempotent: a step already planned for the same (normalised) topology returns its status;
        a planned step is never re-planned for another topology (its slices may be in use), and
        a step whose planning failed can be planned again. Planning a step is exclusive across the
        replicas of a shared store: a request waits for a plan in progress elsewhere, a resumed
        plan (`resumed`) leaves it to that replica.

        Raises:
            NotFoundError: unknown step. ValidationError: bad topology.
            ConflictError: planned for another topology. PlanningError: the planner cannot satisfy it.
            StorageError: the outcome could not be stored; the step shows as failed with this
                error and is planned again when the storage recovers.
        """
        check_step_id(step_id, "step_id")
        cfg = self._config(topology)
        topo = normalized_topology(cfg)
        want = topo.SerializeToString(deterministic=True)
        with self._step_lock(step_id), self.store.plan_lock(step_id, wait=not resumed) as mine:
            rec = self.store.get(step_id)
            if rec.state == PLANNED:
                if rec.topology == want:
                    return self._status(rec)
                raise ConflictError(
                    f"topology: step {step_id!r} is already planned for another topology; submit the "
                    "rollouts under a new batch_id to plan them differently"
                )
            with self._guard:
                unstored = step_id in self._unstored
            if not mine or (resumed and rec.state != SUBMITTED and not unstored):
                return self._status(rec)  # another replica plans it, or its planning failed
            try:
                rec = self._plan_locked(rec, cfg, want)
            except StorageError as exc:
                later = "when the disk has room for it" if exc.need else "when the storage recovers"
                msg = f"{exc.message}; the step is planned again {later}"
                with self._guard:
                    self._unstored[step_id] = (msg, topo, exc.need)
                self._notify(step_id)
                raise StorageError(msg, need=exc.need) from None
            with self._guard:
                self._unstored.pop(step_id, None)
        self._notify(step_id)
        return self._status(rec)

    def _plan_locked(self, rec: StepRecord, cfg: PlanConfig, want: bytes) -> StepRecord:
        step_id = rec.step_id
        self.store.request_plan(step_id, want)
        forest = self._forest(step_id, rec.body_sha256)
        t0 = time.perf_counter()
        try:
            plan = _planner().plan_step(forest, cfg)
        except (PlanningError, ValueError) as exc:
            msg = exc.message if isinstance(exc, HartsError) else str(exc)
            self.metrics.plans.labels("failed").inc()
            self.store.save_failure(step_id, topology=want, error=msg)
            with self._guard:
                self._unstored.pop(step_id, None)
            self._notify(step_id)
            raise PlanningError(msg) from None
        except Exception:
            log.exception("planning step %s failed", step_id)
            self.metrics.plans.labels("failed").inc()
            self.store.save_failure(step_id, topology=want, error="internal error while planning")
            with self._guard:
                self._unstored.pop(step_id, None)
            self._notify(step_id)
            raise
        seconds = time.perf_counter() - t0
        slices = self._seal_all(plan, cfg.world_size)
        self.store.save_plan(step_id, topology=want, stats=plan.header.stats.SerializeToString(deterministic=True),
                             slices=slices)
        for r, data in enumerate(slices):
            self._slices.put((step_id, r), data)
        st = plan.header.stats
        self.metrics.plans.labels("planned").inc()
        self.metrics.plan_seconds.observe(seconds)
        self.metrics.compression_ideal.observe(st.compression_ideal)
        self.metrics.compression_achieved.observe(st.compression_achieved)
        log.info("planned step %s: %d microbatches, compression %.2fx achieved / %.2fx ideal, %.3f s",
                 step_id, st.microbatches, st.compression_achieved, st.compression_ideal, seconds)
        return self.store.get(step_id)

    @staticmethod
    def _seal_all(plan: plan_pb2.Plan, world_size: int) -> list[bytes]:
        if len(plan.ranks) != world_size:
            raise AssertionError(f"planner returned {len(plan.ranks)} ranks for world_size {world_size}")
        return [seal(slice_plan(plan, r)) for r in range(world_size)]

    def _plan_background(self, step_id: str, topology: planner_pb2.Topology, resumed: bool) -> None:
        try:
            self.plan(step_id, topology, resumed=resumed)
        except NotFoundError:
            log.info("step %s was deleted before it was planned", step_id)
        except HartsError as exc:
            log.warning("step %s not planned: %s", step_id, exc.message)
        except Exception:  # logged with its traceback by plan()
            pass
        finally:
            with self._guard:
                self._queued.discard(step_id)

    # ---- fetch

    def fetch(self, step_id: str, rank: int) -> bytes:
        """Sealed slice bytes of one rank (identical on every call).

        Raises:
            NotFoundError: unknown step or rank outside the topology. NotReadyError: not planned yet.
            PlanningError: planning failed (the status says why). StorageError: the plan could
            not be stored or read (retry; it is planned again when the storage recovers).
        """
        check_step_id(step_id, "step_id")
        if rank < 0:
            raise ValidationError("rank", f"expected >= 0, got {rank}")
        cached = self._slices.get((step_id, rank))
        if cached is not None:
            return cached
        rec = self.store.get(step_id)
        if rec.state != PLANNED:
            with self._guard:
                unstored = self._unstored.get(step_id)
            if unstored is not None:
                raise StorageError(unstored[0])
        if rec.state == FAILED:
            raise PlanningError(f"step {step_id!r} could not be planned: {rec.error}")
        if rec.state != PLANNED:
            raise NotReadyError(f"step {step_id!r} is not planned yet; retry, or long-poll with a wait")
        if rank >= rec.world_size:
            raise NotFoundError(f"rank: expected 0 <= rank < {rec.world_size} (the step's world_size), got {rank}")
        data = self.store.slice(step_id, rank)
        if data is None:
            raise NotFoundError(f"step_id: no step {step_id!r} (deleted while it was read)")
        self._slices.put((step_id, rank), data)
        return data

    async def fetch_async(self, step_id: str, rank: int, wait: float = 0.0) -> bytes:
        """`fetch` with long-poll: wait up to `wait` seconds (clipped to max_wait_seconds) for the
        step to be submitted and planned (or the storage to recover). Raises fetch's errors when
        the wait runs out, ValidationError for a wait that is negative or not a number."""
        wait = float(wait)
        if not (wait >= 0 and math.isfinite(wait)):
            raise ValidationError("wait_seconds", f"expected a finite number of seconds >= 0, got {wait!r}")
        check_step_id(step_id, "step_id")
        cached = self._slices.get((step_id, rank))
        if cached is not None:
            return cached
        wait = min(wait, self.cfg.max_wait_seconds)
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
                    return await loop.run_in_executor(self._read_pool, self.fetch, step_id, rank)
                except (NotReadyError, NotFoundError, StorageError) as exc:
                    if isinstance(exc, NotFoundError) and exc.message.startswith("rank:"):
                        raise
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise
                    if self._closing:
                        raise Unavailable("the service is stopping; retry (on another replica, if there is one)") from None
                self.metrics.fetch_waiters.inc()
                try:
                    # a storage fault is not announced when it clears: look again every second;
                    # a shared store's notifications may be missed while its listener reconnects
                    timeout = min(remaining, 1.0) if self.store.fault else remaining
                    if self.store.shared:
                        timeout = min(timeout, _SHARED_POLL_S)
                    await asyncio.wait_for(event.wait(), timeout)
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

    # ---- delete and retention

    def delete(self, step_id: str, *, cause: str = "request") -> planner_pb2.StepStatus:
        """Delete a step, its body and its plan (a plan in progress finishes first).

        Its batch_id can be submitted again afterwards (as a new step).

        Returns:
            the step's status as it was before the deletion.
        Raises:
            NotFoundError: unknown step. StorageError: the database cannot be written.
        """
        check_step_id(step_id, "step_id")
        with self._step_lock(step_id):
            st = self._status(self.store.get(step_id))
            if not self.store.delete(step_id):
                raise NotFoundError(f"step_id: no step {step_id!r}")
            self._slices.pop_where(lambda key: key[0] == step_id)
            self._forests.pop_where(lambda key: key[0] == step_id)
            with self._guard:
                self._unstored.pop(step_id, None)
        self.metrics.steps_deleted.labels(cause).inc()
        self._maintenance.deleted()
        self._notify(step_id)
        return st

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
        if rec.state != PLANNED:
            with self._guard:
                unstored = self._unstored.get(rec.step_id)
            if unstored is not None:
                st.state = FAILED
                st.error = unstored[0]
                st.topology.CopyFrom(unstored[1])
        return st

    def status(self, step_id: str) -> planner_pb2.StepStatus:
        check_step_id(step_id, "step_id")
        return self._status(self.store.get(step_id))

    def list_steps(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        """At most `limit` steps (0: the configured default; clipped to it), newest first."""
        if limit < 0:
            raise ValidationError("limit", f"expected >= 0, got {limit}")
        limit = min(limit or self.cfg.list_limit, self.cfg.list_limit)
        return [self._status(r) for r in self.store.list(limit)]

    # ---- async wrappers (run the blocking work off the event loop)

    async def submit_async(self, body: bytes, fmt: str, topology: planner_pb2.Topology | None = None, *,
                           body_sha256: str = ""):
        return await asyncio.to_thread(self.submit, body, fmt, topology, body_sha256=body_sha256)

    async def submit_message_async(self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None,
                                   *, body: bytes | None = None, body_sha256: str = ""):
        return await asyncio.to_thread(self.submit_message, batch, topology, body=body, body_sha256=body_sha256)

    async def plan_async(self, step_id: str, topology: planner_pb2.Topology) -> planner_pb2.StepStatus:
        return await asyncio.get_running_loop().run_in_executor(self._plan_pool, self.plan, step_id, topology)

    async def status_async(self, step_id: str) -> planner_pb2.StepStatus:
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, self.status, step_id)

    async def list_steps_async(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, self.list_steps, limit)

    async def delete_async(self, step_id: str) -> planner_pb2.StepStatus:
        return await asyncio.to_thread(self.delete, step_id)


def _body_digest(body: bytes | bytearray, expected: str) -> str:
    """The hex SHA-256 of a submitted body; IntegrityError when the client's `expected` digest
    ("": none sent) names other bytes."""
    digest = hashlib.sha256(body).hexdigest()
    if expected and expected.lower() != digest:
        shown = expected if len(expected) <= 64 else expected[:61] + "..."
        raise IntegrityError("body_sha256", f"expected the SHA-256 of the batch bytes received ({digest}), got "
                             f"{shown!r} from the client: the request was altered in transit; nothing was stored, "
                             "send it again")
    return digest


def _too_large(size: int, limit: int) -> LimitError:
    """The error of a request body over the configured size."""
    return LimitError(f"request: expected at most {limit} bytes, got {size}")


def _planner():
    # Imported on use: the planner package pulls in its Numba modules.
    import planner_service.planner as planner

    return planner
