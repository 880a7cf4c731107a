"""`harts rl`: the whole RL loop on one machine: planner, generator and trainer ranks.

    run_rl(load_rl_config("examples/rl_tiny.toml"))                 # a live run, recorded in run.out
    run_rl(cfg_with_no_sharing, replay=Path("runs/rl_tiny"))         # the same steps, trajectory-expanded

A live run: warm start, `harts serve` on loopback, `torchrun` trainer ranks exporting every step,
and the generator in this process (waits for an export within the staleness bound, samples trees,
records, submits). A replay trains a recorded run's batches and compares per step. The steps,
OUT's files, evaluation and the summary: docs/design/training-loop.md ("`harts rl`").
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from trainer.rl.config import RLConfig
from trainer.step_dirs import step_name

log = logging.getLogger("harts.rl")

__all__ = ["run_rl", "RLError", "quiet_libraries", "compare_curves", "reward_rise", "compression_summary", "plan_batch"]


def quiet_libraries() -> None:
    """No progress bars or advisory warnings from transformers / huggingface_hub in this process and
    the ones it starts (what `harts -v rl` keeps); set before they are imported."""
    for key, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):
        os.environ.setdefault(key, value)


class RLError(Exception):
    """A failure of the run the user can act on (one line, with the log to read)."""


def reward_rise(lines: list[dict], window: int = 10) -> dict:
    """Mean reward_mean of the first and the last `window` steps and their difference; with fewer
    than 2 x window steps the window shrinks to half the steps, so the two never overlap (no rise
    with fewer than 2 steps)."""
    r = [ln["reward_mean"] for ln in lines if "reward_mean" in ln]
    w = min(window, len(r) // 2)
    if w < 1:
        return {"window": 0} if r else {}
    first, last = float(np.mean(r[:w])), float(np.mean(r[-w:]))
    return {"reward_first": first, "reward_last": last, "reward_rise": last - first, "window": w}


def compression_summary(lines: list[dict]) -> dict:
    """Mean compression over the steps: the planner's (expanded / computed tokens of the trained
    plans) and the rollouts' own (expanded / distinct tokens of the trees)."""
    planned = [ln["compression"] for ln in lines if "compression" in ln]
    trees = [ln["rollout_expanded_tokens"] / ln["rollout_unique_tokens"] for ln in lines
             if ln.get("rollout_unique_tokens")]
    out = {}
    if planned:
        out["compression_mean"] = float(np.mean(planned))
    if trees:
        out["rollout_compression_mean"] = float(np.mean(trees))
    return out


def compare_curves(a: list[dict], b: list[dict], keys: tuple[str, ...] = ("loss", "grad_norm")) -> dict:
    """Per key: the largest relative difference |a - b| / max(|a|, |b|) over the steps both have."""
    by_step = {ln["step"]: ln for ln in b}
    out: dict = {"steps": 0}
    for key in keys:
        worst, at = 0.0, None
        for ln in a:
            other = by_step.get(ln["step"])
            if other is None or key not in ln or key not in other:
                continue
            x, y = float(ln[key]), float(other[key])
            rel = abs(x - y) / max(abs(x), abs(y)) if max(abs(x), abs(y)) > 0 else 0.0
            if rel >= worst:
                worst, at = rel, ln["step"]
        out[f"{key}_max_rel_diff"], out[f"{key}_worst_step"] = worst, at
    out["steps"] = sum(1 for ln in a if ln["step"] in by_step)
    return out


def plan_batch(cfg: RLConfig):
    """`(batch JSON, model config) -> Plan` of one rank with this run's plan section: what the warm
    start (`trainer.rl.warmstart`) trains on."""
    from planner_service.ingest import forest_from_json
    from planner_service.planner import PlanConfig, plan_step

    def plan(doc: dict, mc):
        return plan_step(forest_from_json(doc), PlanConfig(
            world_size=1, microbatch_tokens=cfg.plan.microbatch_tokens, chunk_size=cfg.plan.chunk_size,
            conv_kernel=mc.linear_conv_kernel_dim, model_config=mc.to_hf_dict(), windows=not cfg.plan.no_windows))

    return plan


class _TrainerLines:
    """Reads OUT/trainer.jsonl as the rank-0 trainer appends it."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, {}

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind("\n") + 1
        self.offset += len(data[:cut].encode())
        for line in data[:cut].splitlines():
            if line.strip():
                doc = json.loads(line)
                self.lines[int(doc["step"])] = doc


class _Loop:
    """One run's processes and bookkeeping (docs/design/training-loop.md, "`harts rl`")."""

    def __init__(self, cfg: RLConfig, out: Path, replay: Path | None):
        from trainer.rl.inputs import conversation, instance_source, run_task

        self.cfg, self.out, self.replay = cfg, out, replay
        self.task, self.reward_fn = run_task(cfg)
        self.fmt, self.tokenizer_dir = conversation(cfg)
        self.instances = instance_source(cfg, self.task)
        self._engine = None
        self.planner = self.trainer = None
        self.trainer_log = out / "trainer.log"
        self.lines = _TrainerLines(out / "trainer.jsonl")
        self.rollout: dict[int, dict] = {}
        self.evals: dict[int, float] = {}
        self.written: list[dict] = []
        self.sinks = None
        self.t0 = time.perf_counter()

    # -- processes -----------------------------------------------------------------------------
    def start(self, warm: Path) -> None:
        import yaml

        from planner_service.server import ServerProcess

        self.planner = ServerProcess(self.out / "planner.db", log_path=self.out / "planner.log").start()
        log.info("planner: %s (SQLite %s)", self.planner.http_url, self.out / "planner.db")
        doc = self.cfg.trainer_doc(planner_url=self.planner.http_url, model_dir=warm, out=self.out)
        (self.out / "trainer.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.cfg.run.nproc}",
               "-m", "trainer.train", "--config", str(self.out / "trainer.yaml")]
        self._trainer_out = open(self.trainer_log, "wb")
        self.trainer = subprocess.Popen(cmd, stdout=self._trainer_out, stderr=subprocess.STDOUT,
                                        cwd=Path(__file__).resolve().parents[2], env=dict(os.environ))
        log.info("trainer: %d rank(s) (torchrun, log %s)", self.cfg.run.nproc, self.trainer_log)

    def check_trainer(self) -> None:
        code = self.trainer.poll() if self.trainer is not None else None
        if code not in (None, 0):
            tail = self.trainer_log.read_text(errors="replace").strip().splitlines()[-12:]
            raise RLError(f"the trainer ranks exited with {code}; last lines of {self.trainer_log}:\n" + "\n".join(tail))

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.terminate()
            try:
                self.trainer.wait(60)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
                self.trainer.wait()
        if self.trainer is not None:
            self._trainer_out.close()
        if self.planner is not None:
            self.planner.stop()

    # -- exports and evaluation ----------------------------------------------------------------
    def version(self) -> int:
        from harts_client.engines import resolve_model_dir

        return resolve_model_dir(self.out / "hf")[1]

    def wait_version(self, need: int) -> None:
        deadline = time.monotonic() + self.cfg.run.timeout
        while self.version() < need:
            self.check_trainer()
            self.flush()
            if time.monotonic() > deadline:
                raise RLError(f"no export of version >= {need} after {self.cfg.run.timeout:g} s (run.timeout); "
                              f"see {self.trainer_log}")
            time.sleep(0.1)

    def engine(self):
        """The one inference engine of the run, on OUT/hf (it follows the newest export; evaluation
        loads the version it evaluates into it, the next batch's `reload` the newest again)."""
        from harts_client.engines import make_engine

        if self._engine is None:
            self._engine = make_engine(self.cfg.generator.engine, str(self.out / "hf"),
                                       **self.cfg.generator.engine_options())
        return self._engine

    def evaluate(self, version: int) -> None:
        from harts_client.tree_sampling import SamplingConfig, sample_batch

        path = self.out / "hf" / step_name(version)
        if not path.is_dir():
            log.warning("eval: export %s was pruned (trainer.checkpoint.keep_last_exports); not evaluated", path)
            self.evals[version] = float("nan")
            return
        t0 = time.perf_counter()
        engine = self.engine()
        if engine.model_dir != path:
            engine.load(path, version)
        insts = self.instances.eval(self.cfg.eval.instances)
        greedy = SamplingConfig(branching=[1], max_new_tokens=self.cfg.sampling.max_new_tokens, temperature=0.0)
        groups = sample_batch(engine, self.task, self.fmt, insts, greedy, seed=0, reward_fn=self.reward_fn)
        self.evals[version] = float(np.mean([r for g in groups for r in g.rewards]))
        log.info("eval: policy version %d: eval_reward %.3f on %d held-out instances (greedy, %.1f s)", version,
                 self.evals[version], len(insts), time.perf_counter() - t0)

    def eval_due(self, version: int) -> bool:
        """Whether `version` is evaluated (a replay evaluates nothing: it has no generator)."""
        every = self.cfg.eval.every if self.replay is None else 0
        return bool(every) and (version % every == 0 or version == self.cfg.run.steps)

    def pending_evals(self) -> None:
        """Evaluate every due version that is exported and not evaluated yet."""
        latest = self.version()
        for v in range(0, latest + 1):
            if self.eval_due(v) and v not in self.evals:
                self.evaluate(v)

    # -- metrics -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every merged line whose parts are all there, in step order."""
        self.lines.poll()
        while True:
            n = len(self.written) + 1
            line = self.lines.lines.get(n)
            if line is None or (self.replay is None and n - 1 not in self.rollout):
                return
            if self.eval_due(n) and n not in self.evals:
                return
            merged = {**line, "expanded_tokens_per_s": line.get("tokens_per_s", 0.0), **self.rollout.get(n - 1, {})}
            if n in self.evals and np.isfinite(self.evals[n]):
                merged["eval_reward"] = self.evals[n]
            self.sinks.write(merged)
            self.written.append(merged)
            log.info("step %d/%d: reward %.3f +- %.3f%s | loss %+.5f grad_norm %.4f | compression %.2fx, %.0f expanded "
                     "tok/s | %.0f s", n, self.cfg.run.steps, merged.get("reward_mean", float("nan")),
                     merged.get("reward_std", float("nan")),
                     f" | eval {merged['eval_reward']:.3f}" if "eval_reward" in merged else "",
                     merged["loss"], merged["grad_norm"], merged["compression"], merged["expanded_tokens_per_s"],
                     time.perf_counter() - self.t0)

    # -- the generator -------------------------------------------------------------------------
    def generate(self) -> None:
        from harts_client.client import PlannerClient
        from harts_client.tree_sampling import batch_stats, sample_batch, to_batch

        cfg = self.cfg
        engine = self.engine()
        model_json = (self.out / "warmstart" / "config.json").read_text()
        vocab = json.loads(model_json)["vocab_size"]
        sampling = cfg.sampling.sampling()
        with PlannerClient(self.planner.http_url, timeout=120) as client:
            for s in range(cfg.run.steps):
                clock = time.perf_counter()
                self.wait_version(s - cfg.run.max_staleness)
                waited, clock = time.perf_counter() - clock, time.perf_counter()
                engine.reload()
                loaded, clock = time.perf_counter() - clock, time.perf_counter()
                insts = self.instances.train(s, cfg.sampling.tasks_per_step)
                groups = sample_batch(engine, self.task, self.fmt, insts, sampling, seed=cfg.run.seed * 100_003 + s,
                                      reward_fn=self.reward_fn, id_prefix=f"s{s}/")
                seconds, clock = time.perf_counter() - clock, time.perf_counter()
                step_id = f"{cfg.run.step_prefix}{s}"
                batch = to_batch(groups, step_id, vocab_size=vocab, policy_version=engine.policy_version)
                doc = batch.to_json(cfg.plan.form)
                text = json.dumps(doc, separators=(",", ":"))
                (self.out / "rollouts" / f"{step_id}.json").write_text(text)
                body = batch.to_proto(cfg.plan.form) if cfg.plan.protobuf else doc
                self._submit(client, body, step_id, model_json)
                stats = batch_stats(groups, seconds)
                stats.update(sample_policy_version=engine.policy_version, generator_wait_seconds=waited,
                             reload_seconds=loaded, submit_seconds=time.perf_counter() - clock,
                             wire_bytes=len(body.SerializeToString()) if cfg.plan.protobuf else len(text))
                self.rollout[s] = stats
                log.info("generator: batch %s sampled with policy version %d: %d trajectories, reward %.3f, %.1f s "
                         "(waited %.1f s for the export, loaded it in %.1f s, submitted and planned in %.1f s)", step_id,
                         engine.policy_version, stats["rollout_trajectories"], stats["rollout_reward_mean"], seconds,
                         waited, loaded, stats["submit_seconds"])
                self.pending_evals()
                self.flush()

    def _submit(self, client, body, step_id: str, model_json: str) -> None:
        p = self.cfg.plan
        client.submit(body)
        client.plan(step_id, world_size=self.cfg.run.nproc, microbatch_tokens=p.microbatch_tokens,
                    chunk_size=p.chunk_size, no_sharing=p.no_sharing, no_windows=p.no_windows, model=model_json)

    def submit_recorded(self) -> None:
        from harts_client.client import PlannerClient

        model_json = (self.replay / "warmstart" / "config.json").read_text()
        with PlannerClient(self.planner.http_url, timeout=120) as client:
            for s in range(self.cfg.run.steps):
                step_id = f"{self.cfg.run.step_prefix}{s}"
                doc = json.loads((self.replay / "rollouts" / f"{step_id}.json").read_text())
                self._submit(client, doc, step_id, model_json)
        log.info("replay: submitted %d recorded batches of %s (no_sharing=%s)", self.cfg.run.steps, self.replay,
                 self.cfg.plan.no_sharing)

    def finish(self) -> None:
        """Wait for the trainer's last step, evaluate the final policy, write the rest."""
        deadline = time.monotonic() + self.cfg.run.timeout * max(1, self.cfg.run.steps - len(self.written))
        while self.trainer.poll() is None:
            self.flush()
            if self.replay is None:
                self.pending_evals()
            if time.monotonic() > deadline:
                raise RLError(f"the trainer did not finish; see {self.trainer_log}")
            time.sleep(0.2)
        self.check_trainer()
        self.lines.poll()
        if self.replay is None:
            self.pending_evals()
        self.flush()
        if len(self.written) != self.cfg.run.steps:
            raise RLError(f"the trainer exited after {len(self.written)} of {self.cfg.run.steps} steps; see {self.trainer_log}")


def _log_warnings(out: Path) -> dict:
    """Warnings the trainer ranks and the planner logged ({"trainer_log_warnings": n, ...}), each
    log's first one repeated here: a retried long-poll or a slow step shows in the summary."""
    counts = {}
    for name in ("trainer", "planner"):
        path = out / f"{name}.log"
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if " WARNING " in ln] if path.is_file() else []
        counts[f"{name}_log_warnings"] = len(lines)
        if lines:
            log.warning("%s.log has %d warning(s), the first: %s", name, len(lines), lines[0])
    return counts


def _prepare(out: Path, replay: Path | None) -> None:
    if replay is not None and out.resolve() == replay.resolve():
        raise ValueError(f"--out: expected a folder other than the replayed run {replay}, got the same")
    if out.exists():
        if not (out / "summary.json").exists() and any(out.iterdir()) and not (out / "rl.json").exists():
            raise ValueError(f"run.out: {out} exists and is not a harts rl run folder; choose another --out")
        shutil.rmtree(out)
    (out / "rollouts").mkdir(parents=True)


def _check_replay(cfg: RLConfig, replay: Path) -> None:
    """The replayed run must have the trainer sections, seed and chunk size of this config."""
    path = replay / "rl.json"
    if not path.is_file() or not (replay / "warmstart").is_dir():
        raise ValueError(f"--replay {replay}: expected a harts rl run folder (rl.json, warmstart/, rollouts/), got none")
    rec = json.loads(path.read_text())
    for section, key in (("run", "seed"), ("run", "nproc"), ("run", "step_prefix"), ("run", "max_staleness"),
                         ("plan", "chunk_size"), ("trainer", None)):
        want = rec[section] if key is None else rec[section][key]
        got = cfg.to_dict()[section] if key is None else cfg.to_dict()[section][key]
        if want != got:
            raise ValueError(f"--replay {replay}: {section}{'.' + key if key else ''}: expected the recorded {want!r}, got {got!r}")
    if cfg.run.steps > rec["run"]["steps"]:
        raise ValueError(f"--replay {replay}: run.steps: expected at most the {rec['run']['steps']} recorded steps, "
                         f"got {cfg.run.steps}")


def run_rl(cfg: RLConfig, *, replay: Path | None = None) -> dict:
    """Run (or replay) the loop; returns the summary (also OUT/summary.json).

    Raises:
        RLError: a process failed or timed out (the message names its log).
        ValueError: a configuration or folder the run cannot use.
    """
    from harts_cli.rl.sinks import Sinks, plot_replay, plot_run
    from trainer.rl.warmstart import warm_start
    from trainer.export import point_latest

    out = Path(cfg.run.out).resolve()
    if replay is not None:
        replay = replay.resolve()
        _check_replay(cfg, replay)
    _prepare(out, replay)
    (out / "rl.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    loop = _Loop(cfg, out, replay)
    t0 = time.perf_counter()
    if replay is None:
        warm, history = warm_start(cfg, loop.task, loop.fmt, out / "warmstart", plan_batch=plan_batch(cfg),
                                   instances=loop.instances, tokenizer_dir=loop.tokenizer_dir)
        (out / "warmstart.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    else:
        warm = out / "warmstart"
        shutil.copytree(replay / "warmstart", warm)
    shutil.copytree(warm, out / "hf" / step_name(0))
    point_latest(out / "hf", step_name(0))
    warm_seconds = time.perf_counter() - t0
    loop.sinks = Sinks(out, cfg.metrics, config=cfg.to_dict())
    try:
        loop.start(warm)
        if replay is None:
            loop.generate()
        else:
            loop.submit_recorded()
        loop.finish()
    finally:
        loop.stop()
        loop.sinks.close()
    wall = time.perf_counter() - t0
    summary = {"out": str(out), "steps": len(loop.written), "wall_seconds": wall, "warm_start_seconds": warm_seconds,
               **reward_rise(loop.written), **compression_summary(loop.written), **_log_warnings(out)}
    if 0 in loop.evals:
        summary["eval_reward_warm_start"] = loop.evals[0]
    finals = [ln["eval_reward"] for ln in loop.written if "eval_reward" in ln]
    if finals:
        summary["eval_reward_final"] = finals[-1]
    if cfg.metrics.plot:
        title = f"harts rl: {cfg.task.name}, {cfg.model.name}, {cfg.run.nproc} ranks" + (", expanded" if cfg.plan.no_sharing else "")
        summary["plot"] = str(plot_run(loop.written, out / "rl.png", title=title, warm_eval=loop.evals.get(0)))
    if replay is not None:
        from harts_cli.rl.anchored import recompute_steps

        recorded = [json.loads(x) for x in (replay / "metrics.jsonl").read_text().splitlines() if x.strip()]
        summary["replay_of"] = str(replay)
        summary["comparison"] = compare_curves(recorded, loop.written)
        log.info("replay: trained on its own: %s", json.dumps(summary["comparison"]))
        summary["same_weights"] = compare_curves(recorded, recompute_steps(replay, cfg, steps=cfg.run.steps))
        log.info("replay: on the recorded run's weights of every step: %s", json.dumps(summary["same_weights"]))
        if cfg.metrics.plot:
            rec_label = "recorded run" + (" (expanded)" if json.loads((replay / "rl.json").read_text())["plan"]["no_sharing"] else " (tree)")
            summary["replay_plot"] = str(plot_replay(recorded[: len(loop.written)], loop.written, out / "replay.png",
                                                     labels=(rec_label, "replay" + (" (expanded)" if cfg.plan.no_sharing else " (tree)")),
                                                     title="same rollouts, same seeds"))
        (out / "replay.json").write_text(json.dumps({"trained_on_its_own": summary["comparison"],
                                                     "same_weights": summary["same_weights"]}, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
