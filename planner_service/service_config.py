"""Settings of one planner-service instance, and how a requested topology becomes a PlanConfig.

`ServiceConfig` is what `harts serve` builds from its flags; `topology_to_config` turns a client's
`harts.v1.Topology` (0 fields: the service defaults, the same over HTTP and gRPC) into the planner's
`PlanConfig`, naming the offending `topology.<field>` when it cannot.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from planner_service.errors import ValidationError
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import CostModel
from proto.harts.v1 import planner_pb2

__all__ = ["ServiceConfig", "topology_to_config", "normalized_topology", "check_step_id", "MAX_WORLD_SIZE",
           "MAX_STEP_ID_CHARS", "DEFAULT_MICROBATCH_TOKENS", "MAX_DOCUMENT_CHARS"]

MAX_WORLD_SIZE = 4096
"""Largest data-parallel world a step is planned for (one sealed slice per rank)."""

DEFAULT_MICROBATCH_TOKENS = 4096
"""Microbatch token budget of a topology that names none (HTTP and gRPC alike)."""

MAX_STEP_ID_CHARS = 512
"""Longest step id (batch_id): it is echoed in URLs, errors and gRPC trailers (8 KiB at most)."""

MAX_DOCUMENT_CHARS = 1 << 20
"""Longest model (config.json) or cost-model document a topology may carry, in characters."""

MAX_DOCUMENT_DEPTH = 16
"""Deepest nesting of those documents (a config.json has 3 levels, a cost model's fit report 3)."""

_INT64_MAX = (1 << 63) - 1


def check_step_id(step_id: str, field: str) -> None:
    """Raise ValidationError naming `field` unless `step_id` can be a step id: 1 to 512
    characters, one URL path segment (no '/', not '.' or '..'), no control characters (NUL
    included), not only whitespace. The project's client reaches every id that passes."""
    if len(step_id) > MAX_STEP_ID_CHARS:
        raise ValidationError(field, f"expected at most {MAX_STEP_ID_CHARS} characters, got {len(step_id)}")
    if not step_id.strip():
        raise ValidationError(field, f"expected an id with a visible character, got {step_id!r}")
    if step_id in (".", ".."):
        raise ValidationError(field, f"expected an id other than '.' and '..' (URL path segments that name "
                                     f"no step), got {step_id!r}")
    if "/" in step_id:
        raise ValidationError(field, f"expected no '/' (a step id is one URL path segment), got {step_id!r}")
    bad = next((c for c in step_id if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValidationError(field, f"expected no control characters, got {bad!r} at character {step_id.index(bad)}")

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
            topology_to_config(self.default_topology, conv_kernel=self.conv_kernel, chunk_size=self.default_chunk_size,
                               microbatch_tokens=self.default_microbatch_tokens, cost_model=self.cost_model,
                               model=self.model)


def topology_to_config(topo: planner_pb2.Topology, *, conv_kernel: int = 4, chunk_size: int = 64,
                       microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS, cost_model: str = "",
                       model: str = "") -> PlanConfig:
    """PlanConfig of a requested topology (0 or empty fields take the given defaults; `cost_model`
    and `model` are JSON texts); ValidationError names the offending `topology.<field>`."""
    if topo.world_size < 1:
        raise ValidationError("topology.world_size", f"expected >= 1, got {topo.world_size}")
    if topo.world_size > MAX_WORLD_SIZE:
        raise ValidationError("topology.world_size", f"expected <= {MAX_WORLD_SIZE}, got {topo.world_size}")
    if topo.microbatch_tokens < 0:
        raise ValidationError("topology.microbatch_tokens", f"expected >= 0 (0: default), got {topo.microbatch_tokens}")
    if topo.memory_tokens < 0:
        raise ValidationError("topology.memory_tokens", f"expected >= 0 (0: default), got {topo.memory_tokens}")
    if topo.chunk_size < 0:
        raise ValidationError("topology.chunk_size", f"expected >= 0 (0: default), got {topo.chunk_size}")
    extra = {}
    for name, text in (("model", topo.model or model), ("cost_model", topo.cost_model or cost_model)):
        if text:
            extra[name] = _document(f"topology.{name}", text, "cost model" if name == "cost_model" else "config.json")
    try:
        cfg = PlanConfig(
            world_size=topo.world_size,
            microbatch_tokens=topo.microbatch_tokens or microbatch_tokens,
            memory_tokens=topo.memory_tokens,
            chunk_size=topo.chunk_size or chunk_size,
            conv_kernel=conv_kernel,
            sharing=not topo.no_sharing,
            windows=not topo.no_windows,
            model_config=extra.get("model"),
            dtype=topo.dtype or "float32",
            lockstep=topo.lockstep,
            cross_rank_windows=not topo.no_cross_rank_windows,
            activation_checkpointing=topo.activation_checkpointing or "none",
            expert_parallel=topo.expert_parallel or 1,
            head=topo.head or "full",
            **({"cost_model": CostModel.from_dict(extra["cost_model"])} if "cost_model" in extra else {}),
        )
        row_bytes = cfg.sizes.row_bytes
    except ValueError as exc:
        raise _topology_error(exc) from None
    if cfg.memory_tokens > _INT64_MAX // row_bytes:
        raise ValidationError("topology.memory_tokens",
                              f"expected at most {_INT64_MAX // row_bytes} (the plan's int64 byte budget at "
                              f"{row_bytes} activation bytes per row), got {cfg.memory_tokens}")
    return cfg


def _document(field: str, text: str, what: str) -> Any:
    """The JSON document of a topology's model or cost model, bounded in size and nesting before
    anything reads it; ValidationError naming `field` otherwise."""
    if len(text) > MAX_DOCUMENT_CHARS:
        raise ValidationError(field, f"expected a {what} document of at most {MAX_DOCUMENT_CHARS} characters, "
                                     f"got {len(text)}")
    try:
        doc = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise ValidationError(field, f"expected a {what} JSON document, got one that does not parse: "
                                     f"{str(exc)[:200] or type(exc).__name__}") from None
    depth, stack = 0, [(doc, 1)]
    while stack:  # iterative: a deep document must not exhaust the stack of whoever serialises it again
        value, level = stack.pop()
        if isinstance(value, (dict, list)):
            depth = max(depth, level)
            if depth > MAX_DOCUMENT_DEPTH:
                raise ValidationError(field, f"expected a {what} document nested at most {MAX_DOCUMENT_DEPTH} "
                                             "levels deep, got deeper")
            stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
    return doc


def _topology_error(exc: ValueError) -> ValidationError:
    """A PlanConfig, model config or cost model error ("<key>: ...", "model config <key>: ...",
    "cost model <key>: ...") as a ValidationError naming `topology.<field>[.<key>]`."""
    name, _, msg = str(exc).partition(": ")
    for prefix, field in (("model config", "topology.model"), ("cost model", "topology.cost_model")):
        if name == prefix or name.startswith(prefix + " "):
            key = name[len(prefix):].strip()
            return ValidationError(f"{field}.{key}" if key else field, msg or str(exc))
    if msg and name.isidentifier():
        return ValidationError(f"topology.{name}", msg)
    return ValidationError("topology", str(exc))


def normalized_topology(cfg: PlanConfig) -> planner_pb2.Topology:
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
        lockstep=cfg.lockstep,
        no_cross_rank_windows=not cfg.cross_rank_windows,
        # defaults unset, as topologies stored before these fields were
        activation_checkpointing="" if cfg.activation_checkpointing == "none" else cfg.activation_checkpointing,
        expert_parallel=0 if cfg.expert_parallel == 1 else cfg.expert_parallel,
        head="" if cfg.head == "full" else cfg.head,
    )
