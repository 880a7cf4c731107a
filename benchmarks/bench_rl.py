"""RL benchmark: one run of `examples/rl_tiny.toml`, trained on trees and, on the same rollouts, expanded.

Run: `.venv/bin/python -m benchmarks.bench_rl [--quick] [--steps 50] [--out benchmarks/results]`
(progress on stderr, one JSON object on stdout; with --out also `rl.md`, `rl.json` and the figure
there). `harts bench --only rl` runs it inside the suite.

In one process, one rank: the tree run (the recorded run), the expanded and repacked plans on its
weights of each step (Invariant E over a real run), copies trained on their own (drift), and the
wire size of each rollout form (`wire_sizes`): benchmarks/README.md ("RL: one run on trees and
expanded").
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from harts_client.engines import make_engine
from harts_client.tasks import make_task
from harts_client.tokenizer import ByteTokenizer
from harts_client.tree_sampling import sample_batch, to_batch
from planner_service.ingest import forest_from_json, json_to_proto
from planner_service.planner import PlanConfig, plan_step
from trainer.config import config_from_dict
from trainer.distributed import DistContext
from trainer.executor import Executor, ExecutorConfig
from trainer.export import point_latest, write_hf_dir
from trainer.models import load_model
from trainer.optim import lr_at, make_optimizer, set_lr
from trainer.parallelize import grad_norm_and_clip
from trainer.rl.config import load_rl_config
from trainer.rl.warmstart import warm_start
from trainer.step_dirs import step_name

log = logging.getLogger("bench_rl")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "rl_tiny.toml"
RESULTS = Path(__file__).resolve().parent / "results"
FIGURE = "rl_tree_vs_expanded.png"


class _Policy:
    """One copy of the policy with the trainer's step (world size 1)."""

    def __init__(self, warm: Path, tcfg, chunk_size: int):
        self.model = load_model(warm)
        self.tcfg, self.ctx = tcfg, DistContext()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = tcfg.optimizer
        self.opt = make_optimizer(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.executor = Executor(self.model, ExecutorConfig(chunk_size=chunk_size, objective=tcfg.objective,
                                                            aux_loss_coef=tcfg.executor.aux_loss_coef,
                                                            attention_backend=tcfg.executor.attention_backend))

    def step(self, plan, i: int, *, update: bool = True) -> dict:
        """Loss and grad norm of `plan` on the current weights; with `update`, then the optimizer step."""
        ls, c = self.tcfg.lr_schedule, self.tcfg
        lr = lr_at(i, lr=c.optimizer.lr, total_steps=c.job.steps, warmup_steps=ls.warmup_steps, decay=ls.decay,
                   decay_steps=ls.decay_steps, min_lr_ratio=ls.min_lr_ratio)
        t0 = time.perf_counter()
        set_lr(self.opt, lr)
        res = self.executor.run_step(plan)
        grad_norm = grad_norm_and_clip(self.params, c.optimizer.max_grad_norm, self.ctx, sharded=False)
        if update:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": res.loss, "grad_norm": float(grad_norm), "seconds": time.perf_counter() - t0,
                "computed_tokens": res.computed_tokens, "expanded_tokens": res.expanded_tokens}


def _per_trajectory_form(doc: dict, *, flat: bool = False) -> dict:
    """The same batch with every node field moved onto the trajectories at full path length (the
    explicit-tree form before the compact one); `flat`: as flat trajectories (full token lists)."""
    out = {k: v for k, v in doc.items() if k != "trees"}
    out["trees"], flat_trajs = [], []
    for tree in doc.get("trees", []):
        by_id = {n["id"]: n for n in tree["nodes"]}
        names = [k for k in ("loss_mask", "old_logprobs", "ref_logprobs") if k in tree["nodes"][0]]
        trajs = []
        for t in tree["trajectories"]:
            path, node = [], by_id[t["node"]]
            while True:
                path.insert(0, node)
                if node["parent"] is None:
                    break
                node = by_id[node["parent"]]
            trajs.append({**t, **{k: [x for n in path for x in n[k]] for k in names}})
            if flat:
                flat_trajs.append({"id": t["id"], "tree_id": tree["id"], "tokens": [x for n in path for x in n["tokens"]],
                                   **{k: v for k, v in trajs[-1].items() if k not in ("id", "node")}})
        nodes = [{k: v for k, v in n.items() if k not in names} for n in tree["nodes"]]
        out["trees"].append({"id": tree["id"], "nodes": nodes, "trajectories": trajs})
    if flat:
        del out["trees"]
        out["trajectories"] = flat_trajs
    return out


def wire_sizes(batch) -> dict:
    """Bytes per expanded token of one batch (a RolloutBatchBuilder) in each form, JSON (compact
    separators, as PlannerClient sends it) and protobuf."""
    compact = batch.to_json("tree")
    expanded = forest_from_json(compact).expanded_tokens
    docs = {"flat": _per_trajectory_form(compact, flat=True), "tree_per_trajectory": _per_trajectory_form(compact)}
    forms = {**{name: (doc, json_to_proto(doc)) for name, doc in docs.items()}, "tree_compact": (compact, batch.to_proto("tree"))}
    out = {"expanded_tokens": expanded, "trajectories": len(batch.trajectories) + sum(len(t.trajectories) for t in batch.trees)}
    for name, (doc, msg) in forms.items():
        out[f"{name}_json_bytes_per_token"] = len(json.dumps(doc, separators=(",", ":"))) / expanded
        out[f"{name}_proto_bytes_per_token"] = len(msg.SerializeToString()) / expanded
    return out


def _rel(a: float, b: float) -> float:
    m = max(abs(a), abs(b))
    return abs(a - b) / m if m > 0 else 0.0


def run(quick: bool = False, steps: int | None = None, out_dir: Path | None = None, config: Path = CONFIG) -> dict:
    """Run the benchmark; returns the per-step rows and the summary (benchmarks/README.md, "RL: one run on trees and expanded")."""
    steps = steps or (5 if quick else 50)
    cfg = load_rl_config(config, steps=steps, nproc=1)
    if quick:
        cfg.warmup.steps, cfg.sampling.tasks_per_step = 30, 4  # 30: the policy knows the format (non-zero rewards)
    tcfg = config_from_dict(cfg.trainer_doc(planner_url="http://unused", model_dir=Path("."), out=Path(".")))
    task = make_task(cfg.task.name, **cfg.task.options)
    tok = ByteTokenizer()
    torch.manual_seed(cfg.run.seed)
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        bench = _SideBySide(cfg, tcfg, task, tok, Path(tmp))
        wire = bench.wire_sizes()
        log.info("wire: %s", json.dumps({k: round(v, 2) for k, v in wire.items()}))
        rows = bench.train(steps)
    result = {"settings": {"config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
                           "steps": steps, "tasks_per_step": cfg.sampling.tasks_per_step,
                           "branching": cfg.sampling.branching, "model": cfg.model.name,
                           "warm_start_steps": cfg.warmup.steps, "quick": quick, "threads": torch.get_num_threads()},
              **_summary(rows), "warm_start_seconds": bench.warm_seconds, "wire": wire, "rows": rows}
    out_dir = Path(out_dir) if out_dir is not None else (Path(tempfile.mkdtemp(prefix="bench-rl-")) if quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    result["figure"] = str(_figure(rows, out_dir / FIGURE))
    return result


class _SideBySide:
    """One benchmark run: the warm-started tree run, its expanded copies, its exports and the
    generator that samples from them (benchmarks/README.md, "RL: one run
    on trees and expanded")."""

    def __init__(self, cfg, tcfg, task, tok: ByteTokenizer, tmp: Path):
        self.cfg, self.task, self.tok = cfg, task, tok
        t0 = time.perf_counter()

        def plan_batch(doc: dict, mc):  # as harts_cli.rl.run.plan_batch (the benchmarks do not import the CLI)
            return plan_step(forest_from_json(doc), PlanConfig(
                world_size=1, microbatch_tokens=cfg.plan.microbatch_tokens, chunk_size=cfg.plan.chunk_size,
                conv_kernel=mc.linear_conv_kernel_dim, model_config=mc.to_hf_dict(), windows=not cfg.plan.no_windows))

        self.warm, _ = warm_start(cfg, self.task, self.tok, tmp / "warmstart", plan_batch=plan_batch,
                                  tokenizer_files=self.tok.hf_files())
        self.warm_seconds = time.perf_counter() - t0
        self.tree, self.expanded, self.repacked, self.anchor = (_Policy(self.warm, tcfg, cfg.plan.chunk_size)
                                                                for _ in range(4))
        self.exports = tmp / "hf"
        self.exports.mkdir()
        self.mc = self.tree.model.config
        self._export(0)
        self.engine = make_engine("transformers", str(self.exports))
        self.common = dict(world_size=1, microbatch_tokens=cfg.plan.microbatch_tokens, chunk_size=cfg.plan.chunk_size,
                           conv_kernel=self.mc.linear_conv_kernel_dim, model_config=self.mc.to_hf_dict())

    def _export(self, version: int) -> None:
        write_hf_dir(self.exports / step_name(version), self.tree.model.state_dict(), self.mc, dtype=torch.float32,
                     meta={"policy_version": version}, files_from=self.warm)
        point_latest(self.exports, step_name(version))

    def sample(self, s: int) -> tuple[dict, float]:
        """Batch s from the newest export (the tree form) and its mean reward."""
        cfg = self.cfg
        self.engine.reload()
        seed = cfg.run.seed * 100_003 + s
        insts = self.task.instances("train", cfg.sampling.tasks_per_step, seed=seed)
        groups = sample_batch(self.engine, self.task, self.tok, insts, cfg.sampling.sampling(), seed=seed,
                              id_prefix=f"s{s}/")
        doc = to_batch(groups, f"rl-{s}", vocab_size=self.mc.vocab_size,
                       policy_version=self.engine.policy_version).to_json("tree")
        return doc, float(np.mean([r for g in groups for r in g.rewards]))

    def wire_sizes(self) -> dict:
        """`wire_sizes` of a 32 x 8 batch of the warm-started policy."""
        insts = self.task.instances("train", 32, seed=999_999)
        groups = sample_batch(self.engine, self.task, self.tok, insts, self.cfg.sampling.sampling(), seed=999_999)
        return wire_sizes(to_batch(groups, "wire", vocab_size=self.mc.vocab_size, policy_version=0))

    def train(self, steps: int) -> list[dict]:
        """Every step's row; batch s + 1 is sampled before step s trains (staleness 1)."""
        pending = self.sample(0)
        rows = []
        for s in range(steps):
            doc, reward = pending
            if s + 1 < steps:
                pending = self.sample(s + 1)  # staleness 1: batch s + 1 comes from the weights before step s
            rows.append(self._step(s, steps, doc, reward))
        return rows

    def _step(self, s: int, steps: int, doc: dict, reward: float) -> dict:
        """Step s on the batch: the tree run and the copies train, the anchor measures; its row."""
        forest = forest_from_json(doc)
        longest = int(forest.traj_length().max())
        common, no_windows = self.common, self.cfg.plan.no_windows
        tree_plan = plan_step(forest, PlanConfig(**common, windows=not no_windows))
        exp_plan = plan_step(forest, PlanConfig(**{**common, "microbatch_tokens": max(self.cfg.plan.microbatch_tokens, longest)},
                                                sharing=False, windows=False))
        one_plan = plan_step(forest, PlanConfig(**{**common, "microbatch_tokens": forest.expanded_tokens},
                                                sharing=False, windows=False))
        self.anchor.model.load_state_dict(self.tree.model.state_dict())  # anchored: the tree run's weights of this step
        ae, ar = self.anchor.step(exp_plan, s, update=False), self.anchor.step(one_plan, s, update=False)
        a, b, c = self.tree.step(tree_plan, s), self.expanded.step(exp_plan, s), self.repacked.step(one_plan, s)
        self._export(s + 1)
        row = {"step": s + 1, "reward_mean": reward, "tree_loss": a["loss"], "tree_grad_norm": a["grad_norm"],
               "anchored_expanded_loss": ae["loss"], "anchored_expanded_grad_norm": ae["grad_norm"],
               "expanded_loss": b["loss"], "expanded_grad_norm": b["grad_norm"],
               "anchored_loss_rel_diff": _rel(a["loss"], ae["loss"]),
               "anchored_grad_norm_rel_diff": _rel(a["grad_norm"], ae["grad_norm"]),
               "anchored_repack_loss_rel_diff": _rel(ar["loss"], ae["loss"]),
               "anchored_repack_grad_norm_rel_diff": _rel(ar["grad_norm"], ae["grad_norm"]),
               "loss_rel_diff": _rel(a["loss"], b["loss"]), "grad_norm_rel_diff": _rel(a["grad_norm"], b["grad_norm"]),
               "repack_loss_rel_diff": _rel(c["loss"], b["loss"]),
               "repack_grad_norm_rel_diff": _rel(c["grad_norm"], b["grad_norm"]),
               "compression": a["expanded_tokens"] / max(a["computed_tokens"], 1),
               "tree_seconds": a["seconds"], "expanded_seconds": b["seconds"]}
        log.info("step %d/%d: reward %.3f | same weights: loss rel %.1e, grad norm rel %.1e (repacked %.1e) | "
                 "free-running: loss rel %.1e, grad norm rel %.1e (repacked %.1e) | %.2fx compression, "
                 "%.2f s tree / %.2f s expanded", s + 1, steps, reward, row["anchored_loss_rel_diff"],
                 row["anchored_grad_norm_rel_diff"], row["anchored_repack_grad_norm_rel_diff"], row["loss_rel_diff"],
                 row["grad_norm_rel_diff"], row["repack_grad_norm_rel_diff"], row["compression"], a["seconds"],
                 b["seconds"])
        return row


def _summary(rows: list[dict]) -> dict:
    """The largest relative differences over the steps, the wall-clock ratio, compression and reward."""
    tree_s, exp_s = sum(r["tree_seconds"] for r in rows), sum(r["expanded_seconds"] for r in rows)
    r = [row["reward_mean"] for row in rows]
    return {
        "anchored_loss_max_rel_diff": max(row["anchored_loss_rel_diff"] for row in rows),
        "anchored_grad_norm_max_rel_diff": max(row["anchored_grad_norm_rel_diff"] for row in rows),
        "anchored_repack_loss_max_rel_diff": max(row["anchored_repack_loss_rel_diff"] for row in rows),
        "anchored_repack_grad_norm_max_rel_diff": max(row["anchored_repack_grad_norm_rel_diff"] for row in rows),
        "loss_max_rel_diff": max(row["loss_rel_diff"] for row in rows),
        "grad_norm_max_rel_diff": max(row["grad_norm_rel_diff"] for row in rows),
        "repack_loss_max_rel_diff": max(row["repack_loss_rel_diff"] for row in rows),
        "repack_grad_norm_max_rel_diff": max(row["repack_grad_norm_rel_diff"] for row in rows),
        "tree_train_seconds": tree_s, "expanded_train_seconds": exp_s, "wall_clock_ratio": exp_s / tree_s,
        "compression_mean": float(np.mean([row["compression"] for row in rows])),
        "reward_first10": float(np.mean(r[:10])), "reward_last10": float(np.mean(r[-10:])),
    }


def _figure(rows: list[dict], path: Path) -> Path:
    # optional: matplotlib only where the figure is drawn, its Agg backend chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(7.5, 10), sharex=True)
    axes[0].plot(steps, [r["reward_mean"] for r in rows], "o-", ms=3, color="C2")
    axes[0].set_ylabel("reward_mean")
    axes[0].set_title("harts rl (examples/rl_tiny.toml): the same rollouts trained as trees and expanded")
    for ax, key in zip(axes[1:3], ("loss", "grad_norm")):
        ax.plot(steps, [r[f"tree_{key}"] for r in rows], "o-", ms=4, label="tree (sharing windows)")
        ax.plot(steps, [r[f"anchored_expanded_{key}"] for r in rows], "x", ms=6, label="expanded, on the tree run's weights")
        ax.plot(steps, [r[f"expanded_{key}"] for r in rows], "--", lw=1, label="expanded, trained on its own")
        ax.set_ylabel(key)
        ax.legend(fontsize=7)
    floor = 1e-10  # a difference of exactly 0 is drawn at the bottom
    ax = axes[3]
    ax.semilogy(steps, [max(r["anchored_loss_rel_diff"], floor) for r in rows], "o-", ms=3, label="loss, same weights")
    ax.semilogy(steps, [max(r["anchored_grad_norm_rel_diff"], floor) for r in rows], "x-", ms=3,
                label="grad norm, same weights")
    ax.semilogy(steps, [max(r["anchored_repack_grad_norm_rel_diff"], floor) for r in rows], ":", color="0.4",
                label="grad norm, same weights: expanded vs expanded repacked")
    ax.semilogy(steps, [max(r["grad_norm_rel_diff"], floor) for r in rows], "-", color="C3", lw=1,
                label="grad norm, each trained on its own")
    ax.semilogy(steps, [max(r["repack_grad_norm_rel_diff"], floor) for r in rows], ":", color="C3",
                label="grad norm, each on its own: expanded vs repacked")
    ax.axhline(1e-6, color="k", lw=0.8, ls="--", label="1e-6")
    ax.set_ylabel("relative difference to expanded")
    ax.set_xlabel("step")
    ax.legend(fontsize=6, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def result_markdown(result: dict) -> str:
    s = result["settings"]
    out = ["# RL: the same run on trees and trajectory-expanded", "",
           f"Command: `.venv/bin/python -m benchmarks.bench_rl --out benchmarks/results` (settings: {json.dumps(s)}). "
           "One process, one rank, the tree and the expanded copy trained side by side on the same recorded batches.", "",
           f"- tree vs expanded on the same weights (every step: the tree run's weights), max relative difference over "
           f"{s['steps']} steps: loss {result['anchored_loss_max_rel_diff']:.2e}, grad norm "
           f"{result['anchored_grad_norm_max_rel_diff']:.2e} (target <= 1e-6, fp32 CPU); the expanded plan against itself "
           f"repacked into one microbatch: loss {result['anchored_repack_loss_max_rel_diff']:.2e}, grad norm "
           f"{result['anchored_repack_grad_norm_max_rel_diff']:.2e} (the reassociation both carry)",
           f"- each trained on its own from the same warm start (the rounding differences grow step over step, as "
           f"between any two fp32 runs): loss {result['loss_max_rel_diff']:.2e}, grad norm "
           f"{result['grad_norm_max_rel_diff']:.2e}; the expanded run against itself repacked, likewise: loss "
           f"{result['repack_loss_max_rel_diff']:.2e}, grad norm {result['repack_grad_norm_max_rel_diff']:.2e}",
           f"- training wall clock: tree {result['tree_train_seconds']:.1f} s, expanded {result['expanded_train_seconds']:.1f} s: "
           f"**{result['wall_clock_ratio']:.2f}x** (mean compression {result['compression_mean']:.2f}x; shared machine)",
           f"- reward_mean: first 10 steps {result['reward_first10']:.3f}, last 10 {result['reward_last10']:.3f}",
           f"- figure: [{FIGURE}]({FIGURE})", "",
           f"Wire size of a {result['wire']['trajectories']}-trajectory batch (32 instances x 8, sampled by the warm-started "
           f"policy; {result['wire']['expanded_tokens']:,} expanded tokens), bytes per expanded token:", "",
           "| form | JSON | protobuf |", "|---|---|---|"]
    for name, label in (("flat", "flat trajectories"), ("tree_per_trajectory", "explicit trees, per-trajectory fields"),
                        ("tree_compact", "explicit trees, per-token fields on the nodes (compact)")):
        w = result["wire"]
        out.append(f"| {label} | {w[name + '_json_bytes_per_token']:.2f} | {w[name + '_proto_bytes_per_token']:.2f} |")
    out += ["",
            "Per step (same weights: the expanded plan on the tree run's weights of the step; own: the expanded copy "
            "trained on its own):", "",
            "| step | reward | tree loss | expanded loss, same weights | rel diff | tree grad norm | expanded grad norm, "
            "same weights | rel diff | grad norm rel diff, own | compression | tree s | expanded s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['step']} | {r['reward_mean']:.3f} | {r['tree_loss']:.8f} | {r['anchored_expanded_loss']:.8f} | "
                   f"{r['anchored_loss_rel_diff']:.1e} | {r['tree_grad_norm']:.7f} | {r['anchored_expanded_grad_norm']:.7f} | "
                   f"{r['anchored_grad_norm_rel_diff']:.1e} | {r['grad_norm_rel_diff']:.1e} | {r['compression']:.2f} | "
                   f"{r['tree_seconds']:.2f} | {r['expanded_seconds']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 steps on a smaller batch (smoke run)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default 50, quick 5)")
    p.add_argument("--out", type=Path, default=None, help="write rl.md, rl.json and the figure into this folder")
    p.add_argument("--config", type=Path, default=CONFIG, help="harts rl config (default examples/rl_tiny.toml)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    result = run(quick=args.quick, steps=args.steps, out_dir=args.out, config=args.config)
    if args.out:
        (args.out / "rl.json").write_text(json.dumps(result, indent=1))
        (args.out / "rl.md").write_text(result_markdown(result))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
