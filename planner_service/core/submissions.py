"""Submitting a step's rollouts: size and digest checks, ingest, an idempotent insert, a plan queued.

    submit(body) -> ingest (validates, builds the Forest) -> Store.insert_step (idempotent by
                    batch_id and the batch's content digest) -> if a topology is given or
                    configured, plan in the background planning pool

Idempotency compares content: the same batch_id with the same content (however it was
serialised: JSON spelling, key order, or protobuf) is a duplicate; with other content it is a
conflict. The body is stored as it came, and its SHA-256 is what the response carries.
See docs/design/service.md.
"""
from __future__ import annotations

import hashlib
import time

from google.protobuf.message import DecodeError

from planner_service import ingest
from planner_service.core.caches import StepCaches
from planner_service.core.config import ServiceConfig
from planner_service.core.digest import DIGEST_VERSION, forest_digest
from planner_service.core.maintenance import Maintenance
from planner_service.core.metrics import Metrics
from planner_service.core.planning import Planning
from planner_service.core.unstored import UnstoredPlans
from planner_service.core.waiters import Waiters
from planner_service.errors import ConflictError, IntegrityError, LimitError
from planner_service.forest import Forest
from planner_service.ids import check_step_id
from planner_service.store import SUBMITTED, StepRecord, Store
from planner_service.topology import normalized_topology
from planner_service.wire_errors import wire_error
from proto.harts.v1 import planner_pb2, rollouts_pb2

__all__ = ["Submissions"]


class Submissions:
    """Validates and stores submitted rollouts; queues their plans."""

    def __init__(self, *, cfg: ServiceConfig, store: Store, caches: StepCaches, waiters: Waiters,
                 unstored: UnstoredPlans, metrics: Metrics, planning: Planning, maintenance: Maintenance):
        self.cfg, self.store, self.caches, self.waiters = cfg, store, caches, waiters
        self.unstored, self.metrics, self.planning, self.maintenance = unstored, metrics, planning, maintenance

    def submit(self, body: bytes | bytearray, fmt: str, topology: planner_pb2.Topology | None = None, *,
               body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        """Validate and store a step's rollouts; plan them in the background if a topology applies.

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
        digest = self._check_body(body, body_sha256)
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
        digest = self._check_body(body, body_sha256)
        forest = ingest.forest_from_proto(batch, self.cfg.limits)
        return self._store_forest(forest, "proto", body, digest, topology)

    def _check_body(self, body: bytes | bytearray, expected: str) -> str:
        """The hex SHA-256 of a submitted body; LimitError over the size limit, IntegrityError when
        the client's `expected` digest ("": none sent) names other bytes."""
        limit = self.cfg.max_request_bytes
        if self.cfg.limits is not None:
            limit = min(limit, self.cfg.limits.max_body_bytes)
        if len(body) > limit:
            raise LimitError(f"request: expected at most {limit} bytes, got {len(body)}")
        digest = hashlib.sha256(body).hexdigest()
        if expected and expected.lower() != digest:
            shown = expected if len(expected) <= 64 else expected[:61] + "..."
            raise IntegrityError("body_sha256", f"expected the SHA-256 of the batch bytes received ({digest}), got "
                                 f"{shown!r} from the client: the request was altered in transit; nothing was "
                                 "stored, send it again")
        return digest

    def _store_forest(self, forest: Forest, fmt: str, body: bytes | bytearray, body_sha256: str,
                      topology: planner_pb2.Topology | None) -> planner_pb2.SubmitRolloutsResponse:
        check_step_id(forest.batch_id, "batch_id")
        if topology is not None and topology.ByteSize() == 0:
            topology = None
        topology = topology if topology is not None else self.cfg.default_topology
        planned_for = normalized_topology(self.cfg.plan_config(topology)) if topology is not None else None
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
            topology=planned_for.SerializeToString(deterministic=True) if planned_for is not None else None,
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
            self.caches.forests.put((rec.step_id, digest), forest)
            if planned_for is not None:
                self.planning.queue(rec.step_id, planned_for)
            self.waiters.notify(rec.step_id)
            if self.cfg.retain_steps:
                self.maintenance.wake()
        elif planned_for is not None and rec.state == SUBMITTED and rec.topology is None:
            self.store.request_plan(rec.step_id, planned_for.SerializeToString(deterministic=True))
            self.planning.queue(rec.step_id, planned_for)
        return planner_pb2.SubmitRolloutsResponse(status=self.unstored.status(rec), duplicate=duplicate,
                                                  body_sha256=body_sha256)

    def _same_content(self, old: StepRecord, digest: str) -> bool:
        if old.body_sha256 == digest:
            return True
        if not old.body_sha256.startswith(DIGEST_VERSION + ":"):
            # a row of an earlier version (keyed by its body bytes, or by a digest that left out
            # some fields): digest what it stored
            return forest_digest(self.caches.forest(self.store, old.step_id, old.body_sha256)) == digest
        return False
