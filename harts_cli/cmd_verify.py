"""Run a batch's tree plan and its trajectory-expanded plan on the same weights and compare them.

    harts verify rollouts.json --model tiny --chunk-size 8 --microbatch-tokens 512 [--memory-tokens 2048]
    harts verify rollouts.json --model tiny --no-replay          # ablation: shows the difference
    harts verify rollouts.json --model tiny --f64-reference      # both runs against a float64 oracle

Prints one JSON object (log-prob, loss, gradient, linear-output and expert-load differences,
`targets_met`); the exit code is 0 either way. The fields: README.md ("What `harts plan`,
`harts verify` and `harts calibrate` print"); the measures: docs/design/numerics.md.
"""
from __future__ import annotations

import argparse
import json
import logging

from harts_cli.cmd_logprobs import add_model_arguments, plan_config
from harts_cli.inputs import load_forest

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--no-replay", action="store_true", help="ablation: tree plan hands over states at unaligned branch depths")
    parser.add_argument("--aggregation", default="token-mean", help="loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL weight (needs ref_logprobs in the batch)")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    parser.add_argument("--repack-baseline", action="store_true",
                        help="also run the expanded plan packed with another budget and report its own differences "
                             "(the reassociation noise floor Invariant E allows) under `baseline_repacked`")
    parser.add_argument("--f64-reference", action="store_true",
                        help="also run the expanded plan on a float64 copy of the weights and report each fp32 run's "
                             "log-prob and relative gradient error against it under `f64_reference` (is the tree's "
                             "difference bigger than the expanded run's own fp32 error?); targets_met is unchanged")


def run(args: argparse.Namespace) -> int:
    import copy

    import numpy as np

    from planner_service.planner import PlanConfig, plan_step
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model
    from trainer.objectives import ObjectiveConfig
    from trainer.verify import compare_runs, f64_reference_report, run_and_capture

    forest = load_forest(args.input, args.format)
    model = build_model(args.model, seed=args.seed)
    K = model.config.linear_conv_kernel_dim
    longest = int(forest.traj_length().max()) if forest.num_trajectories else 1
    common = dict(chunk_size=args.chunk_size, conv_kernel=K, windows=False, all_positions=True)
    tree = plan_step(forest, plan_config(args, forest, model.config, replay=not args.no_replay))
    expanded = plan_step(forest, PlanConfig(microbatch_tokens=max(args.microbatch_tokens, longest), sharing=False, **common))
    obj = ObjectiveConfig(aggregation=args.aggregation, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef)
    ex = Executor(model, ExecutorConfig(chunk_size=args.chunk_size, backend=args.backend, objective=obj,
                                        attention_backend=args.attention_backend, want_logprobs=True, capture_linear=True))
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, tree)
    rep = compare_runs(ref, g_ref, got, g_got)
    rep["targets_met"] = bool(
        rep.get("linear_outputs_bitwise_equal", True) and rep["logprob_max_abs_diff"] <= 1e-5
        and rep["grad_rel_diff_max"] <= 1e-5 and rep["expert_load_equal"]
    )
    rep["replay"] = not args.no_replay
    rep["windows"], rep["recomputed_microbatches"] = got.windows, got.recomputed_microbatches
    rep["microbatches_tree"] = got.microbatches
    rep["compression_ideal"] = float(tree.header.stats.compression_ideal)
    rep["seconds_tree"], rep["seconds_expanded"] = round(got.seconds, 4), round(ref.seconds, 4)
    if args.repack_baseline:
        B = max(args.microbatch_tokens, longest)
        alt = plan_step(forest, PlanConfig(microbatch_tokens=longest if B > longest else 2 * B, sharing=False, **common))
        again, g_again = run_and_capture(ex, alt)
        base = compare_runs(ref, g_ref, again, g_again)
        rep["baseline_repacked"] = {k: base[k] for k in (
            "logprob_max_abs_diff", "loss_diff", "grad_rel_diff_max", "grad_rel_diff_raw_max", "linear_outputs_bitwise_equal")}
        rep["baseline_repacked"]["microbatches"] = again.microbatches
    if args.f64_reference:
        model.zero_grad(set_to_none=True)  # the fp32 gradients are already captured; do not copy them
        model64 = copy.deepcopy(model).double()
        # the PyTorch kernel whatever --backend says: it computes in the inputs' float64
        ex64 = Executor(model64, ExecutorConfig(chunk_size=args.chunk_size, backend="ref", objective=obj, want_logprobs=True))
        ref64, g_ref64 = run_and_capture(ex64, expanded)
        rep["f64_reference"] = f64_reference_report(ref64, g_ref64, {"tree": (got, g_got), "expanded": (ref, g_ref)})
        rep["f64_reference"]["seconds"] = round(ref64.seconds, 4)
    rep = {k: (float(v) if isinstance(v, np.floating) else v) for k, v in rep.items()}
    log.info("verify: log-prob diff %.3g, grad rel diff %.3g, linear bitwise %s, loads equal %s",
             rep["logprob_max_abs_diff"], rep["grad_rel_diff_max"], rep.get("linear_outputs_bitwise_equal"), rep["expert_load_equal"])
    print(json.dumps(rep))
    return 0
