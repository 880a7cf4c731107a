"""Trainer entry point: each torchrun rank long-polls its plan slices from the planner and trains (DESIGN §5.7).

    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml
    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml \\
        --objective.clip_high 0.28 --job.steps 10 --checkpoint.export_every 2
    python -m trainer.train --config ...   # one process (world size 1, no torchrun needed)
    harts train --nproc-per-node 2 ...     # the same CLI; launches torchrun itself
    python -m trainer.train --help         # every field of the config, with its default

The run is one `trainer.config.TrainerConfig`: a TOML or YAML file (`--config`, see
examples/train_tiny_fsdp.toml) overridden by dotted flags (`--section.field value`); the flags
of earlier releases (`--steps`, `--lr`, `--planner-url`, `--checkpoint-dir`, ...) still work.

Step i (0-based) trains the planner step `job.step_ids[i]`, or `<job.step_prefix><i>`. Every rank
builds the model from `job.seed`, applies `trainer.parallelize` (FSDP2 by default, or
`--data-parallel replicate`), long-polls its own slice of the step's plan (the next one is
fetched in the background while the current one trains), runs it with the executor (no
gradient communication until the rank's last backward; a rank without microbatches runs a
zero-loss stand-in so that it takes part in the collectives), SUM-reduces gradients once, clips
them, sets the scheduled learning rate, steps AdamW and logs one metrics line from rank 0
(`trainer.metrics` lists the keys; JSONL and TensorBoard). The plan's world size must equal
torchrun's, and its chunk size, conv kernel and vocabulary the model's.

Checkpoints (sharded DCP: model, optimizer, step; loadable at any world size) go to
`checkpoint.dir` every `checkpoint.every` steps and after the last one, keeping the newest
`checkpoint.keep_last`; `checkpoint.resume` continues from the newest one. Every
`checkpoint.export_every` steps rank 0 writes a Hugging Face directory for the generators
(`trainer.export`) carrying the policy version (= completed steps). A batch submitted with a
`policy_version` older than `staleness.max_staleness` versions is rejected (skipped) or
down-weighted (`staleness.mode`); one newer than the trainer's version (negative staleness) is an
error naming both versions. SIGTERM (on any rank) finishes the current step, checkpoints
and exits 0 (a rank still waiting for a plan exits at once, keeping the previous checkpoint).
Errors (bad config, planner unreachable, a plan for another topology, vocabulary or chunk size)
print one line per rank and exit 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from trainer.config import ConfigError, TrainerConfig, add_config_arguments, config_from_namespace, to_dict

log = logging.getLogger("trainer.train")

__all__ = ["TrainerConfig", "TrainError", "train", "add_arguments", "config_from_args", "main", "staleness_scale"]


class TrainError(Exception):
    """A failure the user can act on (shown as one line, no traceback)."""


def staleness_scale(trainer_version: int, batch_version: int | None, cfg) -> tuple[int | None, float]:
    """(staleness, gradient factor) of a batch; factor 0.0 means reject (skip the step).

    staleness = trainer_version - batch_version (None when the batch carries no version: no bound).
    Within `cfg.max_staleness` (or unbounded, -1) the factor is 1; beyond it "reject" gives 0 and
    "downweight" gives decay ** (staleness - max_staleness).
    """
    if batch_version is None:
        return None, 1.0
    s = trainer_version - batch_version
    if cfg.max_staleness < 0 or s <= cfg.max_staleness:
        return s, 1.0
    if cfg.mode == "reject":
        return s, 0.0
    return s, cfg.decay ** (s - cfg.max_staleness)


def batch_policy_version(header) -> int | None:
    """The policy_version a step's batch was sampled with, when the plan carries one."""
    if "policy_version" not in header.DESCRIPTOR.fields_by_name or not header.HasField("policy_version"):
        return None
    return int(header.policy_version)


def train(cfg: TrainerConfig) -> dict:
    """Run the training loop on this rank; returns the last step's metrics (rank 0's view).

    Side effects: joins (and finally leaves) the torchrun process group (FSDP2 without torchrun:
    a one-rank group in memory), handles SIGTERM while it runs, writes checkpoints, exports and
    metrics.
    Raises:
        TrainError: planner unreachable, a plan this rank cannot run, a checkpoint of another run.
    """
    # torch and the model are imported here, not at the top, so that `harts --help` stays fast.
    import torch

    from trainer import checkpoint
    from harts_client.client import ChecksumError, PlannerClient, PlannerError, RetryPolicy
    from trainer.distributed import init_distributed, shutdown
    from trainer.executor import Executor, ExecutorConfig
    from trainer.metrics import MetricsWriter
    from trainer.models import build_model
    from trainer.optim import make_optimizer
    from trainer.parallelize import GradSync, make_mesh, parallelize

    stop = _StopFlag()
    stop.install()
    fsdp = cfg.parallelism.data_parallel == "fsdp"
    ctx = init_distributed(single_process_group=fsdp)
    prefix = f"[rank {ctx.rank}/{ctx.world_size}] "
    client = None
    try:
        torch.manual_seed(cfg.job.seed)
        try:
            model = build_model(cfg.model.name, seed=cfg.job.seed).to(ctx.device)
            model = parallelize(model, make_mesh(cfg.parallelism, ctx), cfg.parallelism, ctx)
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optimizer
        opt = make_optimizer(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        ex_cfg = dict(chunk_size=cfg.executor.chunk_size, backend=cfg.executor.backend, objective=cfg.objective,
                      attention_backend=cfg.executor.attention_backend,
                      aux_loss_coef=cfg.executor.aux_loss_coef, want_entropies=cfg.metrics.entropy)
        executor = Executor(model, ExecutorConfig(**ex_cfg))
        stand_in = Executor(model, ExecutorConfig(**ex_cfg, validate="none"))
        sync = GradSync(model, ctx)

        start = _resume(cfg, model, opt, checkpoint) if cfg.checkpoint.resume else 0
        if start >= cfg.job.steps:
            log.info("checkpoint already has %d of %d steps; nothing to do", start, cfg.job.steps)
            return {"step": start}

        client = PlannerClient(cfg.planner.url, token=cfg.planner.token, retry=RetryPolicy(attempts=4, backoff_s=0.2))
        try:
            client.wait_ready(cfg.planner.ready_timeout)
        except TimeoutError:
            raise TrainError(f"planner at {cfg.planner.url}: not reachable or not ready after {cfg.planner.ready_timeout:g} s "
                             "(check --planner.url and that `harts serve` is running)") from None
        if ctx.is_main:
            log.info("planner %s ready; training steps %d..%d of %d (%s, %d rank(s))", cfg.planner.url, start + 1,
                     cfg.job.steps, cfg.job.steps, cfg.parallelism.data_parallel, ctx.world_size)

        def fetch(i: int):
            sid = cfg.step_id(i)
            timeout = cfg.planner.plan_timeout
            try:
                return client.fetch_plan(sid, ctx.rank, timeout=timeout, poll=min(30.0, timeout))
            except PlannerError as exc:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: the planner answered {exc}") from None
            except TimeoutError:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: no plan after {timeout:g} s "
                                 "(was the step submitted and planned?)") from None
            except ChecksumError as exc:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: corrupted plan slice: {exc}") from None

        try:
            writer = MetricsWriter(cfg.metrics, is_main=ctx.is_main, resume_step=start if cfg.checkpoint.resume else -1)
        except (OSError, ValueError) as exc:
            raise TrainError(f"metrics: {exc}") from None
        prefetch = _Prefetch(fetch, start)
        last: dict = {}
        try:
            for i in range(start, cfg.job.steps):
                sid = cfg.step_id(i)
                t_wait = time.perf_counter()
                plan = prefetch.get(i, stop)
                if plan is None:
                    log.warning("SIGTERM while waiting for the plan of step %r: exiting after %d completed steps "
                                "(no new checkpoint)", sid, i)
                    last["stopped"] = True
                    break
                wait_seconds = time.perf_counter() - t_wait
                if i + 1 < cfg.job.steps:
                    prefetch.start(i + 1)
                last, stopping = _train_step(plan, i, cfg, ctx, executor, stand_in, sync, model, params, opt, stop)
                last["wait_seconds"] = wait_seconds
                done = i + 1
                if ctx.is_main:
                    log.info("step %d/%d %s loss %.6f grad_norm %.4g lr %.3g tokens %d computed / %d expanded (%.2fx) "
                             "%.3f s %.0f tok/s%s", done, cfg.job.steps, sid, last["loss"], last["grad_norm"], last["lr"],
                             last["computed_tokens"], last["expanded_tokens"], last["compression"], last["seconds"],
                             last["tokens_per_s"], " (stale batch rejected)" if last.get("skipped") else "")
                writer.write(last)
                _save_and_export(cfg, ctx, model, opt, checkpoint, done, final=done == cfg.job.steps or stopping)
                if stopping:
                    if ctx.is_main:
                        log.warning("SIGTERM: stopped after step %d of %d", done, cfg.job.steps)
                    break
        finally:
            writer.close()
        return last
    except TrainError as exc:
        raise TrainError(prefix + str(exc)) from None
    finally:
        stop.uninstall()
        if client is not None:
            client.close()
        shutdown(ctx)


def _train_step(plan, i: int, cfg: TrainerConfig, ctx, executor, stand_in, sync, model, params, opt,
                stop: "_StopFlag") -> tuple[dict, bool]:
    """One step on this rank: run the slice, SUM-reduce gradients, clip, schedule the lr, AdamW.

    Returns:
        (metrics reduced over ranks, whether any rank has seen SIGTERM).
    """
    from proto.arrays import unpack
    from trainer.distributed import all_reduce_values
    from trainer.metrics import STAT_MAX, STAT_MIN, STAT_SUMS, advantage_partials, moments, peak_memory_mib, \
        reward_metrics, stat_metrics
    from trainer.optim import lr_at, set_lr
    from trainer.parallelize import grad_norm_and_clip, participation_slice, run_slice, scale_grads

    sid = cfg.step_id(i)
    t0 = time.perf_counter()
    _check_slice(plan, sid, ctx)
    version = batch_policy_version(plan.header)
    if version is not None and version > i:
        raise TrainError(f"step {sid!r}: the batch's policy_version {version} is newer than this trainer's policy "
                         f"version {i} (completed steps): expected a batch sampled with version <= {i}; was it "
                         "sampled from another run's exports, or is the trainer behind its checkpoint?")
    staleness, factor = staleness_scale(i, version, cfg.staleness)
    ls = cfg.lr_schedule
    lr = lr_at(i, lr=cfg.optimizer.lr, total_steps=cfg.job.steps, warmup_steps=ls.warmup_steps, decay=ls.decay,
               decay_steps=ls.decay_steps, min_lr_ratio=ls.min_lr_ratio)
    set_lr(opt, lr)
    if ctx.device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(ctx.device)
    res, grad_norm, n_mb = None, 0.0, len(plan.rank.microbatches)
    if factor > 0:
        runner, work = executor, plan
        if not n_mb:  # no microbatches here: a zero-loss stand-in keeps this rank in the collectives
            runner, work = stand_in, participation_slice(plan, conv_kernel=model.config.linear_conv_kernel_dim)
        try:
            res = run_slice(runner, work, sync)  # forward + backward of every microbatch
        except ValueError as exc:
            raise TrainError(f"step {sid!r}: {exc}") from None
        sync.finish_step(params)
        scale_grads(params, factor)
        grad_norm = grad_norm_and_clip(params, cfg.optimizer.max_grad_norm, ctx, sharded=sync.fsdp)
        opt.step()
    opt.zero_grad(set_to_none=True)

    real = res is not None and n_mb > 0
    stats = res.stats if real else {}
    adv = advantage_partials(plan)
    sums = [res.loss if real else 0.0, res.policy_loss if real else 0.0, res.kl if real else 0.0,
            res.aux_loss if real else 0.0, res.computed_tokens if real else 0, res.loss_tokens if real else 0.0, n_mb,
            res.windows if real else 0, res.recomputed_microbatches if real else 0,
            float(stop.requested), *adv[:3]]
    sums += [float(stats.get(k, 0.0)) for k in STAT_SUMS] + [float(k in stats) for k in STAT_SUMS]
    maxes = [adv[3], peak_memory_mib(ctx.device)] + [float(stats.get(k, float("-inf"))) for k in STAT_MAX]
    mins = [adv[4]] + [float(stats.get(k, float("inf"))) for k in STAT_MIN]
    sums = all_reduce_values(sums, ctx, "sum")
    maxes = all_reduce_values(maxes, ctx, "max")
    mins = all_reduce_values(mins, ctx, "min")
    loss, policy, kl, aux, computed, loss_tokens, mbs, windows, recomputed, stopping, an, asum, asq = sums[:13]
    k = len(STAT_SUMS)
    stat_sums = {key: v for key, v, have in zip(STAT_SUMS, sums[13:13 + k], sums[13 + k:]) if have > 0}
    stat_max = {key: v for key, v in zip(STAT_MAX, maxes[2:]) if v != float("-inf")}
    stat_min = {key: v for key, v in zip(STAT_MIN, mins[1:]) if v != float("inf")}
    seconds = time.perf_counter() - t0
    expanded = int(plan.header.stats.expanded_tokens) or int(
        unpack(plan.header.trajectory_lengths, "int32", name="trajectory_lengths").sum())
    out = {
        "step": i + 1, "step_id": sid, "policy_version": i + 1, "loss": loss, "policy_loss": policy, "kl": kl,
        "aux_loss": aux, "grad_norm": grad_norm, "lr": lr, "loss_tokens": loss_tokens,
        "computed_tokens": int(computed), "expanded_tokens": expanded,
        "compression": expanded / max(computed, 1.0), "microbatches": int(mbs), "windows": int(windows),
        "recomputed_microbatches": int(recomputed), "seconds": seconds,
        "tokens_per_s": expanded / seconds if factor > 0 else 0.0,
        "computed_tokens_per_s": computed / seconds, "peak_memory_mib": maxes[1], "world_size": ctx.world_size,
        "skipped": int(factor == 0),
    }
    if an > 0:
        out["advantage_mean"], out["advantage_std"] = moments(an, asum, asq)
        out["advantage_min"], out["advantage_max"] = mins[0], maxes[0]
    out.update(stat_metrics(stat_sums, stat_max, stat_min))
    out.update(reward_metrics(plan.header, gather=lambda v: all_reduce_values(v, ctx, "max")))
    if version is not None:
        out.update(batch_policy_version=version, staleness=staleness, staleness_scale=factor)
    return out, stopping > 0


def _save_and_export(cfg: TrainerConfig, ctx, model, opt, checkpoint, done: int, *, final: bool) -> None:
    """Checkpoint (with retention) and export at their intervals; collective."""
    c = cfg.checkpoint
    if c.dir and ((c.every and done % c.every == 0) or final):
        path = checkpoint.save(c.dir, step=done, model=model, optimizer=opt, meta=_meta(cfg, model, done), ctx=ctx)
        if ctx.is_main:
            log.info("checkpoint %s", path)
            for old in checkpoint.prune(c.dir, c.keep_last):
                log.info("checkpoint retention (keep_last=%d): removed %s", c.keep_last, old)
    if c.export_every and (done % c.export_every == 0 or final):
        _export(cfg, ctx, model, done)


def _export(cfg: TrainerConfig, ctx, model, done: int) -> None:
    """Write `<exports>/step-XXXXXXXX` (HF directory, policy_version = done) from rank 0; collective."""
    from pathlib import Path

    from trainer.distributed import barrier
    from trainer.export import DTYPES, point_latest, prune, write_hf_dir
    from trainer.parallelize import is_fsdp

    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    if ctx.is_main:
        root = Path(cfg.checkpoint.exports)
        name = f"step-{done:08d}"
        spec = Path(cfg.model.name)
        out = write_hf_dir(root / name, state, model.config, dtype=DTYPES[cfg.checkpoint.export_dtype],
                           meta={"policy_version": done, "step_ids": [cfg.step_id(j) for j in range(done)]},
                           files_from=spec if spec.is_dir() else None)
        point_latest(root, name)
        prune(root, cfg.checkpoint.keep_last_exports)
        log.info("export %s (policy_version %d)", out, done)
    barrier(ctx)


def _check_slice(plan, sid: str, ctx) -> None:
    """The plan must be made for this topology and this rank."""
    ws = plan.header.params.world_size
    if ws != ctx.world_size:
        raise TrainError(f"step {sid!r}: the plan is for world_size={ws}, but this run has {ctx.world_size} "
                         f"rank(s); launch torchrun with --nproc_per_node={ws} (x nodes) or re-plan the step")
    if plan.rank.rank != ctx.rank:
        raise TrainError(f"step {sid!r}: expected the slice of rank {ctx.rank}, got rank {plan.rank.rank}")


def _meta(cfg: TrainerConfig, model, done: int) -> dict:
    config = to_dict(cfg)
    config["planner"].pop("token", None)  # never write the bearer token to disk
    return {"step_ids": [cfg.step_id(i) for i in range(done)], "model": cfg.model.name, "seed": cfg.job.seed,
            "lr": cfg.optimizer.lr, "model_config": model.config.to_hf_dict(), "config": config}


def _resume(cfg: TrainerConfig, model, opt, checkpoint) -> int:
    """Load the newest checkpoint; returns the number of completed steps (0 without one)."""
    try:
        path = checkpoint.latest(cfg.checkpoint.dir)
        if path is None:
            log.info("--resume: no checkpoint in %s; starting at step 0", cfg.checkpoint.dir)
            return 0
        meta = checkpoint.read_meta(path)
        done = int(meta["step"])
        want = [cfg.step_id(i) for i in range(min(done, cfg.job.steps))]
        if meta.get("step_ids", [])[: len(want)] != want:
            raise TrainError(f"--resume: {path} trained steps {meta.get('step_ids')}, expected this run's "
                             f"first {len(want)} steps {want}")
        checkpoint.load(path, model=model, optimizer=opt)
    except checkpoint.CheckpointError as exc:
        raise TrainError(f"--resume: {exc}") from None
    log.info("resumed from %s after %d steps", path, done)
    return done


class _Prefetch:
    """Fetches one step's plan slice in a daemon thread while the current step trains."""

    def __init__(self, fetch, first: int):
        self.fetch = fetch
        self.index: int | None = None
        self.thread: threading.Thread | None = None
        self.result = None
        self.error: BaseException | None = None
        self.start(first)

    def start(self, i: int) -> None:
        self.index, self.result, self.error = i, None, None

        def work():
            try:
                self.result = self.fetch(i)
            except BaseException as exc:  # re-raised in the main thread by get()
                self.error = exc

        self.thread = threading.Thread(target=work, name=f"plan-prefetch-{i}", daemon=True)
        self.thread.start()

    def get(self, i: int, stop: "_StopFlag"):
        """Step i's slice; None when SIGTERM arrives while it is still being waited for."""
        assert self.index == i and self.thread is not None, f"prefetch of step {self.index}, asked for {i}"
        while self.thread.is_alive():
            self.thread.join(0.1)
            if stop.requested and self.thread.is_alive():
                return None
        if self.error is not None:
            raise self.error
        return self.result


class _StopFlag:
    """SIGTERM sets a flag; the loop reduces it across ranks and stops after the current step."""

    def __init__(self):
        self.requested = False
        self._old = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's flags (shared by `python -m trainer.train` and `harts train`): `--config` and
    one `--section.field` per config field (`trainer.config`)."""
    add_config_arguments(p)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return config_from_namespace(args)


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The torchrun command line that runs this module with `argv` on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainer.train", *argv]


def run(args: argparse.Namespace) -> int:
    """Train with parsed arguments; returns the exit status (errors are printed, not raised)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per long-poll request otherwise
    try:
        cfg = config_from_args(args)
        train(cfg)
    except (TrainError, ConfigError, ValueError) as exc:
        print(f"trainer.train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0],
                                epilog="Example config: examples/train_tiny_fsdp.toml (every field, documented).")
    add_arguments(p)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s", stream=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
