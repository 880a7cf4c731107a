"""The trainer topology a step is planned for, declared once (`FIELDS`).

    cfg = topology_to_config(topo, **service_defaults)   # harts.v1.Topology -> PlanConfig (ValidationError: topology.<field>)
    topo = normalized_topology(cfg)                      # PlanConfig -> the Topology as planned (idempotency compares it)

One `TopologyField` per field of `harts.v1.Topology`; its name is also the JSON key, the POST
/v1/steps query parameter and the CLI flag, and `transport.http_models` and
`harts_cli.topology_flags` derive from `FIELDS`. A new field is a `TopologyField` here, its proto
field (`make proto`; never renumber one) and the PlanConfig field it sets. The bounds of the wire
values and documents: docs/design/service.md ("Ingestion and validation").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from planner_service.errors import ValidationError
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import CostModel
from plan.memory_model import CHECKPOINTING, HEADS
from plan.named_models import qwen3_next_80b_a3b
from proto.harts.v1 import planner_pb2

__all__ = ["TopologyField", "FIELDS", "BY_NAME", "topology_to_config", "normalized_topology", "MAX_WORLD_SIZE",
           "DEFAULT_MICROBATCH_TOKENS", "MAX_DOCUMENT_CHARS", "MAX_DOCUMENT_DEPTH", "INT32", "INT64"]

MAX_WORLD_SIZE = 4096
"""Largest data-parallel world a step is planned for (one sealed slice per rank)."""

DEFAULT_MICROBATCH_TOKENS = 4096
"""Microbatch token budget of a topology that names none (HTTP and gRPC alike)."""

MAX_DOCUMENT_CHARS = 1 << 20
"""Longest model (config.json) or cost-model document a topology may carry, in characters."""

MAX_DOCUMENT_DEPTH = 16
"""Deepest nesting of those documents (a config.json has 3 levels, a cost model's fit report 3)."""

INT32 = 2**31 - 1
INT64 = 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyField:
    """One topology setting: how the wire, the planner, HTTP and the CLI carry it."""

    name: str
    """The harts.v1.Topology field: also its JSON key, query parameter and CLI flag."""
    type: type
    """int, bool or str: the proto field's type (its zero, 0 / False / "", means "unset")."""
    help: str
    """What the setting is (OpenAPI descriptions and CLI help)."""
    required: bool = False
    """A topology names it (a plan request's body must; a submission's query plans at once only with it)."""
    plan_field: str = ""
    """The PlanConfig field it sets; default: `name`, without the `no_` of a negated flag."""
    default: Any = None
    """The PlanConfig value an unset field means (a service may configure its own, `defaults` of
    `topology_to_config`); None: the wire value is used as it is."""
    unset: str = ""
    """What an unset field means, in words (OpenAPI)."""
    minimum: int | None = None
    """Smallest wire value of an int field (0: unset included)."""
    maximum: int | None = None
    """Largest wire value of an int field; longest text of a document."""
    choices: tuple[str, ...] = ()
    """Values of a str field (CLI choices; PlanConfig validates what the wire carries)."""
    elide_default: bool = False
    """`normalized_topology` leaves the default unset (as topologies stored before the field were,
    so that equal requests compare equal)."""
    document: str = ""
    """A JSON document field: what the document is ("config.json", "cost model")."""
    decode: Callable[[Any], Any] | None = None
    """A document's parsed JSON -> its PlanConfig value."""
    encode: Callable[[Any], str] | None = None
    """A document's PlanConfig value -> its normalised text ("" for the default)."""
    metavar: str | None = None
    """The CLI flag's value name."""
    example: Any = None
    """A value other than the unset one, valid together with the other fields' examples (the
    tests carry every field through every surface with these)."""

    def __post_init__(self) -> None:
        if not self.plan_field:
            object.__setattr__(self, "plan_field", self.name[3:] if self.negated else self.name)

    @property
    def negated(self) -> bool:
        """A `no_<setting>` flag: the PlanConfig field is its negation."""
        return self.type is bool and self.name.startswith("no_")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def description(self) -> str:
        """The OpenAPI description: what it is and what unset means."""
        return f"{self.help}; unset: {self.unset}" if self.unset else self.help

    def check_wire(self, value: Any) -> None:
        """ValidationError naming `topology.<name>` for a wire value out of bounds."""
        if self.type is not int:
            return
        if self.minimum is not None and value < self.minimum:
            hint = " (0: default)" if self.minimum == 0 else ""
            raise ValidationError(f"topology.{self.name}", f"expected >= {self.minimum}{hint}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise ValidationError(f"topology.{self.name}", f"expected <= {self.maximum}, got {value}")

    def to_plan(self, value: Any, default: Any = None) -> Any:
        """The PlanConfig value of a (non-document) wire value; `default` replaces the field's own."""
        if self.negated:
            return not value
        fallback = self.default if default is None else default
        return value if value or fallback is None else fallback

    def to_wire(self, value: Any) -> Any:
        """The normalised wire value of a PlanConfig value."""
        if self.encode is not None:
            return self.encode(value)
        if self.negated:
            return not value
        if self.elide_default and value == self.default:
            return self.type()
        return value


FIELDS: tuple[TopologyField, ...] = (
    TopologyField(name="world_size", type=int, required=True, minimum=1, maximum=MAX_WORLD_SIZE, example=4,
                  help="Number of data-parallel trainer ranks W"),
    TopologyField(name="microbatch_tokens", type=int, minimum=0, maximum=INT32, default=DEFAULT_MICROBATCH_TOKENS,
                  example=256,
                  help="Token budget B per microbatch (computed rows: kept + replay + duplicated)",
                  unset=f"the service default (`harts serve --microbatch-tokens`, {DEFAULT_MICROBATCH_TOKENS} unless "
                        "set), over HTTP and gRPC alike"),
    TopologyField(name="memory_tokens", type=int, minimum=0, maximum=INT64, default=0, example=4096,
                  help="Live-activation budget M per rank, in rows of the model's activations",
                  unset="what a device leaves after the model's shards and gathered units (with a model), else 8 x "
                        "microbatch_tokens"),
    TopologyField(name="chunk_size", type=int, minimum=0, maximum=INT32, default=64, example=16,
                  help="Linear-attention chunk size C (a power of two: the kernel's)",
                  unset="the service default (`harts serve --chunk-size`, 64 unless set)"),
    TopologyField(name="no_sharing", type=bool, example=True,
                  help="Plan the trajectory-expanded baseline (every trajectory its own tree, standard packing)"),
    TopologyField(name="no_windows", type=bool, example=True,
                  help="Duplicate the prefix of every cross-microbatch edge instead of opening sharing windows "
                       "(the ablation)"),
    TopologyField(name="model", type=str, plan_field="model_config", document="config.json", maximum=MAX_DOCUMENT_CHARS,
                  decode=lambda doc: doc,
                  encode=lambda cfg: json.dumps(cfg, sort_keys=True) if cfg is not None else "",
                  example=json.dumps(qwen3_next_80b_a3b(), sort_keys=True),
                  help="The trainer's model as a Qwen3-Next config.json document (JSON text): the memory model sizes "
                       "open windows from it",
                  unset="the service default (`harts serve --model`; Qwen3-Next-80B-A3B unless set)"),
    TopologyField(name="dtype", type=str, default="float32", choices=("float32", "bfloat16"), example="bfloat16",
                  help="Trainer dtype for the memory model (float32, bfloat16)", unset="float32"),
    TopologyField(name="cost_model", type=str, document="cost model", maximum=MAX_DOCUMENT_CHARS,
                  decode=CostModel.from_dict,
                  encode=lambda cost: cost.to_json() if cost != CostModel() else "",
                  example=CostModel(row=1.0, attention=0.002, linear_call=4.0, source="example").to_json(),
                  help="Cost model JSON written by `harts calibrate`, which placement balances with",
                  unset="the service default (`harts serve --cost-model`; computed rows unless set)"),
    TopologyField(name="lockstep", type=bool, example=True,
                  help="Plan lock-step phases: every rank runs one step of the same kind per phase, so that trainers "
                       "which gather parameters per forward and backward (FSDP2 with "
                       "parallelism.reshard_after_forward) pair their collectives"),
    TopologyField(name="no_cross_rank_windows", type=bool, example=True,
                  help="With lockstep: keep every sharing window on its rank (the ablation of windows across ranks, "
                       "which import a tree's shared prefix from the rank that computes it, plan.proto CrossEdge)"),
    TopologyField(name="activation_checkpointing", type=str, default="none", choices=CHECKPOINTING, elide_default=True,
                  metavar="MODE", unset="none", example="full",
                  help="The trainer's parallelism.activation_checkpointing the memory model counts rows under: none, "
                       "full (every decoder block keeps its input and is recomputed in backward) or selective (the FFN "
                       "sub-block only)"),
    TopologyField(name="expert_parallel", type=int, minimum=0, maximum=MAX_WORLD_SIZE, default=1, elide_default=True,
                  metavar="E", unset="1", example=2,
                  help="The trainer's parallelism.expert_parallel E: every MoE layer's routed experts split over E "
                       "ranks (E divides world_size and the model's num_experts; E > 1 needs lockstep)"),
    TopologyField(name="head", type=str, default="full", choices=HEADS, elide_default=True, unset="full",
                  example="chunked",
                  help="The trainer's lm head for the memory model: full (fp32 logits, the CPU path) or chunked (the "
                       "GPU path, no [rows, V] logits)"),
)

BY_NAME: dict[str, TopologyField] = {f.name: f for f in FIELDS}


def topology_to_config(topo: planner_pb2.Topology, *, conv_kernel: int = 4, **defaults: Any) -> PlanConfig:
    """PlanConfig of a requested topology; ValidationError names the offending `topology.<field>`.

    Args:
        topo: the request's topology (unset fields take the defaults).
        conv_kernel: the trainers' short-convolution kernel size (not a topology field).
        defaults: a service's own defaults by field name (`chunk_size=64`, `model="<json>"`, ...),
            replacing the declared ones.
    """
    unknown = sorted(set(defaults) - set(BY_NAME))
    if unknown:
        raise TypeError(f"topology_to_config: expected defaults of topology fields, got {', '.join(unknown)}")
    for f in FIELDS:
        f.check_wire(getattr(topo, f.name))
    documents = {}
    for f in FIELDS:
        text = (getattr(topo, f.name) or defaults.get(f.name, "")) if f.document else ""
        if text:
            documents[f.name] = _document(f"topology.{f.name}", text, f.document)
    try:
        kwargs = {}
        for f in FIELDS:
            if not f.document:
                kwargs[f.plan_field] = f.to_plan(getattr(topo, f.name), defaults.get(f.name))
            elif f.name in documents:
                kwargs[f.plan_field] = f.decode(documents[f.name])
        cfg = PlanConfig(conv_kernel=conv_kernel, **kwargs)
        row_bytes = cfg.sizes.row_bytes
    except ValueError as exc:
        raise _topology_error(exc) from None
    if cfg.memory_tokens > INT64 // row_bytes:
        raise ValidationError("topology.memory_tokens",
                              f"expected at most {INT64 // row_bytes} (the plan's int64 byte budget at "
                              f"{row_bytes} activation bytes per row), got {cfg.memory_tokens}")
    return cfg


def normalized_topology(cfg: PlanConfig) -> planner_pb2.Topology:
    """The topology as planned: defaults resolved, so equal requests compare equal."""
    return planner_pb2.Topology(**{f.name: f.to_wire(getattr(cfg, f.plan_field)) for f in FIELDS})


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
        plan_to_wire = {f.plan_field: f.name for f in FIELDS}
        return ValidationError(f"topology.{plan_to_wire.get(name, name)}", msg)
    return ValidationError("topology", str(exc))
