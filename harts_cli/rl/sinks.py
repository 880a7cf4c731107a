"""Where `harts rl` writes its per-step metrics: JSONL, TensorBoard, Weights & Biases, a PNG.

    sinks = Sinks(out, cfg.metrics, config=cfg.to_dict())
    sinks.write(line)              # one merged line per trainer step (see harts_cli.rl.run)
    sinks.close(); plot_run(lines, out / "rl.png")

OUT/metrics.jsonl gets one JSON line per step; OUT/tb gets the numeric keys as TensorBoard scalars
`rl/<key>`; with `metrics.wandb_project` set, `wandb.log(line, step=step)` (wandb is imported only
then and is not a dependency: `pip install wandb`; `metrics.wandb_mode = "offline"` or
WANDB_MODE=offline logs without a network, `wandb sync OUT/wandb/...` uploads later).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("harts.rl")

__all__ = ["Sinks", "plot_run", "plot_replay"]


class Sinks:
    """The run's metrics sinks: JSONL, TensorBoard, W&B (module docstring)."""

    def __init__(self, out: Path, cfg, *, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.jsonl = open(out / "metrics.jsonl", "w")
        self.tb = SummaryWriter(str(out / "tb"))
        self.wandb = None
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("metrics.wandb_project: expected the wandb package to be installed "
                                 "(pip install wandb), got none; unset the project to run without W&B") from None
            kw = {"mode": cfg.wandb_mode} if cfg.wandb_mode else {}
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(out), config=config, **kw)

    def write(self, line: dict) -> None:
        self.jsonl.write(json.dumps(line) + "\n")
        self.jsonl.flush()
        step = int(line["step"])
        scalars = {k: v for k, v in line.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}
        for key, value in scalars.items():
            self.tb.add_scalar(f"rl/{key}", value, step)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def plot_run(lines: list[dict], path: Path, *, title: str = "", warm_eval: float | None = None) -> Path:
    """PNG of reward (the mean of the step's rollouts, and eval_reward; `warm_eval`: the warm start's,
    at step 0) and compression per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [ln["step"] for ln in lines]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax.plot(steps, [ln.get("reward_mean", float("nan")) for ln in lines], "o-", ms=3,
            label="reward_mean (sampled rollouts of the step)")
    evals = ([(0, warm_eval)] if warm_eval is not None else []) + [(ln["step"], ln["eval_reward"]) for ln in lines
                                                                   if "eval_reward" in ln]
    if evals:
        ax.plot(*zip(*evals), "s--", ms=4, label="eval_reward (greedy, held-out)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    bx.plot(steps, [ln.get("compression", float("nan")) for ln in lines], "o-", ms=3, color="C2",
            label="compression (expanded / computed tokens)")
    bx.set_ylabel("compression")
    bx.set_xlabel("step")
    bx.legend(loc="lower right", fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_replay(a: list[dict], b: list[dict], path: Path, *, labels: tuple[str, str], title: str = "") -> Path:
    """PNG of loss and grad norm per step of two runs over the same rollouts (tree vs expanded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for ax, key in zip(axes, ("loss", "grad_norm")):
        ax.plot([ln["step"] for ln in a], [ln[key] for ln in a], "o-", ms=4, label=labels[0])
        ax.plot([ln["step"] for ln in b], [ln[key] for ln in b], "x--", ms=5, label=labels[1])
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title(title)
    axes[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
