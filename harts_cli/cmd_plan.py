"""Plan a rollout batch for a trainer topology and print the plan report; or, without a batch,
print the per-rank memory report of a model on a cluster.

    harts plan rollouts.json --world-size 8 --microbatch-tokens 16384 --chunk-size 64 -o plan.bin
    harts plan rollouts.json --world-size 64 --microbatch-tokens 16384 --model config.json --cost-model cost.json
    harts plan batch.pb --world-size 2 --microbatch-tokens 4096 --no-sharing     # expanded baseline
    harts plan rollouts.json --world-size 8 --lockstep                           # lock-step phases
    harts plan --model hybrid-moe-124b --world-size 32 --microbatch-tokens 16384 \
        --activation-checkpointing full --expert-parallel 8 --json              # memory report

What it prints and the flags that size rows and M: README.md ("What `harts plan`, `harts verify`
and `harts calibrate` print", "Planning a cluster: memory per rank").
"""
from __future__ import annotations

import argparse
import json
import logging

from harts_cli.inputs import add_input_arguments, load_forest
from harts_cli.model_arg import resolve_model
from harts_cli.topology_flags import add_topology_arguments, plan_kwargs_from_args
from harts_client.timing import Stopwatch
from plan.cluster_memory import DEFAULT_DEVICE_MEMORY_GB, GIB, PhaseCounts, collective_bytes, memory_report
from plan.named_models import NAMED_MODELS
from plan.validator import validate_plan
from planner_service import ingest
from planner_service.planner import PlanConfig, expand_forest, plan_step, warmup
from planner_service.planner.cost_model import CostModel
from planner_service.topology import BY_NAME
from proto.harts.v1 import plan_pb2

log = logging.getLogger(__name__)

#: PlanStats fields printed, in order.
REPORT_FIELDS = (
    "unique_tokens", "expanded_tokens", "computed_tokens", "replay_tokens", "duplicated_tokens",
    "compression_ideal", "compression_achieved", "microbatches", "linear_attention_calls",
    "rank_costs", "imbalance", "peak_live_tokens", "peak_live_bytes", "makespan", "makespan_lower_bound",
    "makespan_ratio", "plan_seconds", "windows",
)
#: ... and those of a lock-step plan (--lockstep).
LOCKSTEP_FIELDS = (
    "lockstep_phases", "lockstep_forward_phases", "lockstep_backward_phases", "lockstep_recompute_phases",
    "lockstep_makespan", "lockstep_ratio", "cross_edges", "exchanged_bytes", "max_rank_exchanged_bytes",
)
#: PlanCandidate fields of with_cross_edges / without_cross_edges (lock-step plans with cross_rank_windows).
CANDIDATE_FIELDS = ("compression_achieved", "makespan_ratio", "lockstep_makespan", "duplicated_tokens", "cross_edges",
                    "exchanged_bytes", "makespan", "makespan_lower_bound")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser, optional=True)
    topology = parser.add_argument_group("topology (harts.v1.Topology: the service plans for the same settings)")
    add_topology_arguments(topology, defaults={"world_size": 1, "dtype": None, "head": None}, help={
        "memory_tokens": "live window-stack budget M per rank in rows of full activations of --model (default: what "
                         "--device-memory-gb leaves after the model's shards and gathered units; 8 x B without --model)",
        "dtype": "trainer compute dtype for the memory model (default: float32 when planning, bfloat16 for the "
                 "memory report alone)",
        "expert_parallel": "the trainer's parallelism.expert_parallel: every MoE layer's routed experts split over E "
                           "ranks (E divides --world-size and the model's num_experts; planning needs --lockstep); "
                           "default 1",
        "head": "the trainer's lm head for the memory model: full fp32 logits (the CPU path; default when planning) "
                "or chunked (the GPU path; default for the memory report alone)",
    })
    topology.add_argument("--model", default=None,
                          help="trainer model for the memory model: a config.json path or a named config "
                               "(qwen3-next-80b-a3b, hybrid-moe-124b, tiny, small, ...; default: Qwen3-Next-80B-A3B)")
    topology.add_argument("--cost-model", default=None,
                          help="cost model JSON from `harts calibrate` (default: computed rows)")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="memory of one trainer device in GiB (default: plan.cluster_memory.DEFAULT_DEVICE_MEMORY_GB, "
                             "141 for an H200)")
    parser.add_argument("--conv-kernel", type=int, default=0, help="short-convolution kernel size K (default: --model's, else 4)")
    parser.add_argument("--json", action="store_true", help="memory report alone: print it as one JSON object")
    parser.add_argument("--makespan-slack", type=float, default=None,
                        help="placement accepts a makespan this factor above its lower bound to duplicate less (default 1.02)")
    parser.add_argument("--no-replay", action="store_true",
                        help="ablation: hand over states at unaligned branch depths instead of replaying")
    parser.add_argument("--all-positions", action="store_true",
                        help="a log-prob entry for every position, not only loss positions")
    parser.add_argument("--python", action="store_true", help="plain-Python partitioner and builder kernels (reference)")
    parser.add_argument("--all-ranks", action="store_true", help="print every rank's cost, not only min and max")
    parser.add_argument("-o", "--output", help="write the serialised harts.v1.Plan here")


#: settings whose errors name their flag (the rest name the PlanConfig field, as the service does)
FLAGS = {name: BY_NAME[name].flag for name in ("activation_checkpointing", "expert_parallel", "head")}


def _flag_error(exc: ValueError) -> ValueError:
    """`exc` with its leading field name replaced by the flag that sets it (FLAGS)."""
    name, sep, rest = str(exc).partition(": ")
    return ValueError(f"{FLAGS[name]}: {rest}") if sep and name in FLAGS else exc


def memory_only(args: argparse.Namespace) -> int:
    """The memory report of --model (default Qwen3-Next-80B-A3B) on --world-size ranks, no batch."""
    name, config = resolve_model(args.model or "qwen3-next-80b-a3b")
    kw = dict(dtype=args.dtype or "bfloat16", device_memory_gb=args.device_memory_gb or DEFAULT_DEVICE_MEMORY_GB,
              memory_tokens=args.memory_tokens,
              microbatch_tokens=args.microbatch_tokens, chunk_size=args.chunk_size, model_name=name,
              activation_checkpointing=args.activation_checkpointing, expert_parallel=args.expert_parallel,
              head=args.head or "chunked")
    try:
        lockstep = memory_report(config, args.world_size, lockstep=True, **kw)
        free = memory_report(config, args.world_size, lockstep=False, **kw)
    except ValueError as exc:
        raise _flag_error(exc) from None
    if args.json:
        print(json.dumps({**lockstep.to_dict(), "free_schedule": free.to_dict()}))
        return 0
    print("\n".join(lockstep.lines()))
    print(f"free schedule (every unit gathered for the whole step): gathered units {free.gathered_bytes / GIB:.2f} GiB, "
          f"peak with margin {(free.peak_bytes + free.margin_bytes) / GIB:.2f} GiB: {'fits' if free.fits else 'does NOT fit'}")
    return 0


def plan_config(args: argparse.Namespace) -> PlanConfig:
    """The PlanConfig of the flags: the topology's, then the settings only `harts plan` has."""
    extra = {}
    if args.model:
        extra["model_name"], extra["model_config"] = resolve_model(args.model)
    if args.cost_model:
        extra["cost_model"] = CostModel.load(args.cost_model)
    if args.makespan_slack is not None:
        extra["makespan_slack"] = args.makespan_slack
    if args.device_memory_gb is not None:
        extra["device_memory_gb"] = args.device_memory_gb
    try:
        return PlanConfig(**plan_kwargs_from_args(args), conv_kernel=args.conv_kernel, replay=not args.no_replay,
                          all_positions=args.all_positions, **extra)
    except ValueError as exc:
        raise _flag_error(exc) from None


def run(args: argparse.Namespace) -> int:
    if args.input is None:
        return memory_only(args)
    cfg = plan_config(args)
    with Stopwatch() as sw:
        ingest.warmup()
        warmup()
    log.debug("numba warm-up %.3f s", sw.wall)
    forest = load_forest(args.input, args.format)
    log.info("forest: %d trajectories, %d segments, %d distinct tokens", forest.num_trajectories,
             forest.num_segments, forest.unique_tokens)
    plan = plan_step(forest, cfg, impl="ref" if args.python else "numba")
    validate_plan(plan, forest if cfg.sharing else expand_forest(forest))
    report = _report(plan, cfg, all_ranks=args.all_ranks)
    if args.model:
        report["memory_report"] = _memory_section(cfg)
    collectives = _collectives_section(plan, cfg)
    if collectives is not None:
        report["collectives"] = collectives
    _log_plan(plan, cfg)
    if args.output:
        plan.header.stats.plan_seconds = 0.0
        with open(args.output, "wb") as fh:
            fh.write(plan.SerializeToString(deterministic=True))
        report["output"] = args.output
        log.info("wrote %s", args.output)
    print(json.dumps(report))
    return 0


def _report(plan: plan_pb2.Plan, cfg: PlanConfig, *, all_ranks: bool) -> dict:
    """The printed report: the plan's stats, `validated`, the memory budget (README.md, "What `harts
    plan`, `harts verify` and `harts calibrate` print")."""
    st = plan.header.stats
    report = {name: getattr(st, name) for name in REPORT_FIELDS + (LOCKSTEP_FIELDS if cfg.lockstep else ())}
    for name in ("with_cross_edges", "without_cross_edges"):
        if st.HasField(name):
            report[name] = {f: getattr(getattr(st, name), f) for f in CANDIDATE_FIELDS}
    report["rank_costs"] = list(st.rank_costs)
    if len(st.rank_costs) > 16 and not all_ranks:
        report["rank_costs"] = {"min": min(st.rank_costs), "max": max(st.rank_costs), "ranks": len(st.rank_costs)}
    report["validated"] = True
    report["memory_model"] = plan.header.params.memory.model
    report["memory_budget"] = {
        "memory_tokens": cfg.memory_tokens, "memory_bytes": cfg.memory_bytes, "bytes_per_row": cfg.sizes.row_bytes,
        "source": cfg.memory_source, "activation_checkpointing": cfg.activation_checkpointing,
        "expert_parallel": cfg.expert_parallel, "head": cfg.head}
    log.info("memory budget M: %d rows of %d bytes (%s; activation checkpointing %s, expert parallel E = %d, %s lm head)",
             cfg.memory_tokens, cfg.sizes.row_bytes, cfg.memory_source, cfg.activation_checkpointing,
             cfg.expert_parallel, cfg.head)
    return report


def _memory_section(cfg: PlanConfig) -> dict:
    """The per-rank memory report of --model for this topology (logged line by line)."""
    mem = memory_report(cfg.model_config, cfg.world_size, dtype=cfg.dtype, device_memory_gb=cfg.device_memory_gb,
                        lockstep=cfg.lockstep, memory_tokens=cfg.memory_tokens, microbatch_tokens=cfg.microbatch_tokens,
                        chunk_size=cfg.chunk_size, model_name=cfg.model_name,
                        activation_checkpointing=cfg.activation_checkpointing, expert_parallel=cfg.expert_parallel,
                        head=cfg.head)
    for line in mem.lines():
        log.info("%s", line)
    return mem.to_dict()


def _collectives_section(plan: plan_pb2.Plan, cfg: PlanConfig) -> dict | None:
    """A lock-step plan's collective bytes per rank and step (None for a free plan)."""
    phases = PhaseCounts.of(plan.header)
    if phases is None:
        return None
    rank_rows = [(sum(mb.num_rows + mb.replay_tokens for mb in r.microbatches),
                  sum(mb.num_rows + mb.replay_tokens for mb in r.microbatches if mb.recompute)) for r in plan.ranks]
    coll = collective_bytes(cfg.model_config or NAMED_MODELS["qwen3-next-80b-a3b"](), cfg.world_size, dtype=cfg.dtype,
                            phases=phases, expert_parallel=cfg.expert_parallel,
                            activation_checkpointing=cfg.activation_checkpointing, rank_rows=rank_rows)
    log.info("collectives per rank and step: all-gather %.2f GiB, reduce-scatter %.2f GiB (%s)",
             coll.all_gather_bytes / GIB, coll.reduce_scatter_bytes / GIB, coll.formula)
    if coll.all_to_all_bytes:
        log.info("all-to-all of the busiest rank per step: %.2f GiB sent, as much received (%s)",
                 coll.all_to_all_bytes / GIB, coll.all_to_all_formula)
    return coll.to_dict()


def _log_plan(plan: plan_pb2.Plan, cfg: PlanConfig) -> None:
    st = plan.header.stats
    log.info("plan: %d microbatches on %d ranks, compression %.3f of %.3f, imbalance %.3f, %.3f s",
             st.microbatches, cfg.world_size, st.compression_achieved, st.compression_ideal, st.imbalance,
             st.plan_seconds)
    if not cfg.lockstep:
        return
    log.info("lock-step: %d phases (%d forward, %d backward, %d recompute), lockstep_ratio %.3f",
             st.lockstep_phases, st.lockstep_forward_phases, st.lockstep_backward_phases,
             st.lockstep_recompute_phases, st.lockstep_ratio)
    if st.HasField("with_cross_edges"):
        x, b = st.with_cross_edges, st.without_cross_edges
        log.info("windows across ranks: %d edges, %.2f GiB exchanged per step; lock-step makespan %.0f with them "
                 "(compression %.3f), %.0f without (compression %.3f): planned %s", x.cross_edges,
                 x.exchanged_bytes / GIB, x.lockstep_makespan, x.compression_achieved, b.lockstep_makespan,
                 b.compression_achieved, "with them" if st.cross_edges else "without them")
