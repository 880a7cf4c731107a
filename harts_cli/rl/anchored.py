"""Tree vs expanded on the same weights, step by step along a recorded `harts rl` run.

    lines = recompute_steps(Path("runs/rl_tiny"), cfg, steps=40)   # cfg.plan.no_sharing: expanded plans
    compare_curves(recorded_lines, lines)                          # per-step loss / grad norm differences

A replay that trains on its own drifts as any two fp32 AdamW runs do; this checks Invariant E
along the run instead: step n's batch planned with this config, run on the weights step n trained
from (export n), loss and gradient norm scaled by the step's staleness factor as the trainer does
(docs/design/training-loop.md, "`harts rl`").
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from trainer.step_dirs import step_name

log = logging.getLogger("harts.rl")

__all__ = ["recompute_steps"]


def recompute_steps(run_dir: Path, cfg, *, steps: int) -> list[dict]:
    """[{step, loss, grad_norm}] of the recorded steps 1..steps recomputed on the run's own weights.

    Steps whose weights were pruned (trainer.checkpoint.keep_last_exports) or whose batch was
    rejected as stale are left out.
    """
    from planner_service.ingest import forest_from_json
    from planner_service.planner import PlanConfig, plan_step
    from trainer.config import config_from_dict
    from trainer.distributed import DistContext
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import load_model
    from trainer.parallelize import grad_norm_and_clip, scale_grads

    tcfg = config_from_dict(cfg.trainer_doc(planner_url="http://unused", model_dir=Path("."), out=run_dir))
    recorded = {}
    for text in (run_dir / "metrics.jsonl").read_text().splitlines():
        if text.strip():
            line = json.loads(text)
            recorded[int(line["step"])] = line
    model = load_model(run_dir / "hf" / step_name(0))
    params = [p for p in model.parameters() if p.requires_grad]
    executor = Executor(model, ExecutorConfig(chunk_size=cfg.plan.chunk_size, objective=tcfg.objective,
                                              aux_loss_coef=tcfg.executor.aux_loss_coef,
                                              attention_backend=tcfg.executor.attention_backend))
    mc = model.config
    out = []
    for n in range(steps):
        line = recorded.get(n + 1)
        weights = run_dir / "hf" / step_name(n)
        if line is None or line.get("skipped") or not weights.is_dir():
            continue
        model.load_state_dict(load_model(weights).state_dict())
        forest = forest_from_json((run_dir / "rollouts" / f"{cfg.run.step_prefix}{n}.json").read_bytes())
        budget = cfg.plan.microbatch_tokens
        if cfg.plan.no_sharing:
            budget = max(budget, int(forest.traj_length().max()))
        plan = plan_step(forest, PlanConfig(world_size=1, microbatch_tokens=budget, chunk_size=cfg.plan.chunk_size,
                                            conv_kernel=mc.linear_conv_kernel_dim, model_config=mc.to_hf_dict(),
                                            sharing=not cfg.plan.no_sharing,
                                            windows=not (cfg.plan.no_sharing or cfg.plan.no_windows)))
        res = executor.run_step(plan)
        scale_grads(params, float(line.get("staleness_scale", 1.0)))
        grad_norm = grad_norm_and_clip(params, 0.0, DistContext(), sharded=False)
        model.zero_grad(set_to_none=True)
        out.append({"step": n + 1, "loss": res.loss, "grad_norm": grad_norm})
        log.info("same weights: step %d/%d: loss %+.8f (recorded %+.8f), grad norm %.7f (recorded %.7f)", n + 1, steps,
                 res.loss, line["loss"], grad_norm, line["grad_norm"])
    return out
