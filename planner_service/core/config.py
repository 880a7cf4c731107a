"""Settings of one planner-service instance (`ServiceConfig`), what `harts serve` builds from its flags.

Its topology defaults (`topology_defaults`) are what a requested topology's unset fields mean on
this service, over HTTP and gRPC alike (`planner_service.topology.topology_to_config`).
See docs/design/service.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner_service.planner.config import PlanConfig
from planner_service.topology import DEFAULT_MICROBATCH_TOKENS, topology_to_config
from proto.harts.v1 import planner_pb2

__all__ = ["ServiceConfig"]

_MiB = 1024 * 1024


@dataclass(slots=True, kw_only=True)
class ServiceConfig:
    """Settings of one service instance."""

    db_path: str = "harts.db"
    """SQLite database file (WAL mode; ":memory:" keeps nothing across restarts), or the
    `postgresql://...` URL of a database that replicas share (`planner_service.store.postgres`)."""
    token: str | None = None
    """Bearer token every non-health request must carry; None disables auth."""
    max_request_bytes: int = 1024 * _MiB  # ingest's Limits.max_body_bytes
    """Largest request body (HTTP) or message (gRPC) accepted; larger ones get 413 / RESOURCE_EXHAUSTED."""
    limits: Any = None
    """`planner_service.ingest.Limits` for submitted batches; None uses ingest's defaults."""
    default_topology: planner_pb2.Topology | None = None
    """Topology a submission is planned for at once when the request names none; None: wait for PlanStep."""
    conv_kernel: int = 4
    """Short-convolution kernel size K of the trainers' model (goes into every plan)."""
    default_chunk_size: int = 64
    """Chunk size used when a topology says 0."""
    default_microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    """Microbatch token budget used when a topology says 0 (gRPC's unset field) or an HTTP request names none."""
    list_limit: int = 100
    """ListSteps default and maximum page size."""
    max_wait_seconds: float = 60.0
    """Upper bound of a long-poll wait; longer requests are clipped."""
    plan_workers: int = 1
    """Threads that plan steps (planning is CPU-bound Numba code)."""
    slice_cache_bytes: int = 256 * _MiB
    """Bytes of sealed slices kept in memory for fast fetches (least recently used go first)."""
    forest_cache_bytes: int = 256 * _MiB
    """Bytes of submitted forests kept in memory so planning does not re-ingest them."""
    synchronous: str = "FULL"
    """SQLite synchronous pragma (FULL: durable across power loss; NORMAL: across process crashes)."""
    retain_steps: int = 0
    """Keep only the newest this many steps (older ones are deleted with their plans); 0 keeps all."""
    max_age_seconds: float = 0.0
    """Delete steps submitted longer ago than this many seconds; 0 keeps them however old."""
    storage_probe_seconds: float = 5.0
    """How often a healthy database is checked for writability (every second during a fault);
    the check writes nothing."""
    min_free_bytes: int = 64 * _MiB
    """SQLite: writes that would leave less disk space free are refused (503) and the service is
    not ready while less is free, so a full disk never takes the database's own room to recover."""
    resume_seconds: float = 1.0
    """Shared (PostgreSQL) stores: how often a replica looks for plans that a replica which died
    left unfinished (their planning lock is free) and plans them."""
    accept_data_loss: bool = False
    """SQLite: serve a database that lacks writes the service acknowledged (deleted, replaced or
    restored from an older copy while it was down or killed; `store.acked`) as it is. Without it
    the service stays not ready on such a database, saying why."""
    vacuum: bool = False
    """VACUUM the database once at start, before the service is ready (converts a database of an
    earlier version to incremental auto-vacuum, so that deletions shrink the file)."""
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
        if not self.max_wait_seconds >= 0:
            raise ValueError(f"max_wait_seconds: expected >= 0, got {self.max_wait_seconds}")
        if self.plan_workers < 1:
            raise ValueError(f"plan_workers: expected >= 1, got {self.plan_workers}")
        if self.default_microbatch_tokens < 1:
            raise ValueError(f"default_microbatch_tokens: expected >= 1, got {self.default_microbatch_tokens}")
        for name in ("slice_cache_bytes", "forest_cache_bytes", "retain_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not (self.max_age_seconds >= 0 and math.isfinite(self.max_age_seconds)):
            raise ValueError(f"max_age_seconds: expected a finite number >= 0 (0: no age limit), got {self.max_age_seconds}")
        for name in ("storage_probe_seconds", "resume_seconds"):
            value = getattr(self, name)
            if not (0 < value and math.isfinite(value)):
                raise ValueError(f"{name}: expected a finite number > 0, got {value}")
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes: expected >= 0, got {self.min_free_bytes}")
        if self.default_topology is not None:
            self.plan_config(self.default_topology)

    def topology_defaults(self) -> dict[str, Any]:
        """What unset topology fields mean on this service, by field name."""
        return {"chunk_size": self.default_chunk_size, "microbatch_tokens": self.default_microbatch_tokens,
                "cost_model": self.cost_model, "model": self.model}

    def plan_config(self, topology: planner_pb2.Topology) -> PlanConfig:
        """The PlanConfig of a requested topology on this service (ValidationError naming
        `topology.<field>` when it cannot be planned for)."""
        return topology_to_config(topology, conv_kernel=self.conv_kernel, **self.topology_defaults())
