"""The training loop of one torchrun rank: build its shards, poll its plan slices, train, checkpoint, export.

    summary = train(cfg)   # cfg: trainer.config.TrainerConfig; raises TrainError with one line

`trainer.train` is the entry point; it imports this module only once the command line is parsed,
so that `--help` needs no torch. Step by step: docs/design/training-loop.md ("The trainer's step").
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harts_client.client import ChecksumError, PlannerClient, PlannerError, WrongSliceError
from plan.cluster_memory import memory_report
from proto.arrays import unpack
from trainer import checkpoint
from trainer.config import TrainerConfig, to_dict
from trainer.cross_rank import CrossRankError, P2PTransport
from trainer.distributed import all_reduce_values, barrier, init_distributed, shutdown
from trainer.executor import Executor, ExecutorConfig
from trainer.export import DTYPES, export_model, point_latest, prune
from trainer.metrics import (STAT_MAX, STAT_MIN, STAT_SUMS, MetricsWriter, advantage_partials, moments, peak_memory_mib,
                             reward_metrics, stat_metrics)
from trainer.models import build_model, meta_model, model_config
from trainer.optim import lr_at, make_optimizer, set_lr
from trainer.param_memory import ParamGradGauge
from trainer.parallelize import (GradSync, full_param_grad_bytes, grad_norm_and_clip, make_mesh, param_dtype_of,
                                 parallelize, participation_slice, resolve_reshard, run_slice, scale_grads)
from trainer.staleness import batch_policy_version, staleness_scale
from trainer.step_dirs import step_name

log = logging.getLogger(__name__)

__all__ = ["TrainError", "train"]


class TrainError(Exception):
    """A failure the user can act on (shown as one line, no traceback)."""


def train(cfg: TrainerConfig) -> dict:
    """Run the training loop on this rank; returns the last step's metrics (rank 0's view).

    Side effects: joins (and finally leaves) the torchrun process group (FSDP2 without torchrun:
    a one-rank group in memory), handles SIGTERM while it runs, writes checkpoints, exports and
    metrics.
    Raises:
        TrainError: planner unreachable, a plan this rank cannot run, a checkpoint of another run.
    """

    stop = _StopFlag()
    stop.install()
    ctx = init_distributed(single_process_group=cfg.parallelism.data_parallel == "fsdp")
    run = None
    try:
        run = _setup(cfg, ctx, stop)
        if run.start >= cfg.job.steps:
            log.info("checkpoint already has %d of %d steps; nothing to do", run.start, cfg.job.steps)
            return {"step": run.start}
        return _loop(run)
    except TrainError as exc:
        raise TrainError(f"[rank {ctx.rank}/{ctx.world_size}] {exc}") from None
    finally:
        stop.uninstall()
        if run is not None:
            run.close()
        shutdown(ctx)


@dataclass(slots=True, kw_only=True)
class _Run:
    """What `_setup` builds for one rank's run: the model and its optimizer, executors, the planner client."""

    cfg: TrainerConfig
    ctx: object
    """trainer.distributed.DistContext."""
    stop: "_StopFlag"
    model: object
    params: list
    opt: object
    executor: object
    stand_in: object
    """The executor of participation stand-ins (no slice check: `participation_slice` builds them)."""
    sync: object
    reshard: bool
    """parallelism.reshard_after_forward, resolved: lock-step plans only."""
    start: int
    """Completed steps at start (from a resumed checkpoint)."""
    gauge: object = None
    """trainer.param_memory.ParamGradGauge: peak_param_grad_bytes of each step."""
    full_bytes: int = 0
    """full_param_grad_bytes: full parameters plus full gradients."""
    client: object = None
    writer: object = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.client is not None:
            self.client.close()


def _setup(cfg: TrainerConfig, ctx, stop: "_StopFlag") -> _Run:
    """Build this rank's part of the model, make the optimizer and executors, resume, reach the planner."""


    torch.manual_seed(cfg.job.seed)
    resume_from = _resume_path(cfg, checkpoint) if cfg.checkpoint.resume else None
    model, reshard, full_bytes = _build_model(cfg, ctx, init=resume_from is None)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = make_optimizer(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    fsdp = cfg.parallelism.data_parallel == "fsdp"
    ex_cfg = dict(to_dict(cfg.executor), objective=cfg.objective, want_entropies=cfg.metrics.entropy,
                  reach_all_units=fsdp, activation_dtype=param_dtype_of(cfg.parallelism, ctx.device) if fsdp else None,
                  activation_checkpointing=cfg.parallelism.activation_checkpointing)
    # windows across ranks of lock-step plans: batched point-to-point, every wait bounded
    transport = P2PTransport(cfg.parallelism.p2p_timeout_s) if ctx.world_size > 1 else None
    run = _Run(cfg=cfg, ctx=ctx, stop=stop, model=model, params=params, opt=opt, reshard=reshard,
               executor=Executor(model, ExecutorConfig(**ex_cfg), transport=transport),
               stand_in=Executor(model, ExecutorConfig(**ex_cfg, validate="none")),
               sync=GradSync(model, ctx, every_backward=reshard),
               gauge=ParamGradGauge(model, enabled=cfg.metrics.param_grad_bytes), full_bytes=full_bytes,
               start=_resume(cfg, resume_from, model, opt, checkpoint) if resume_from is not None else 0)
    if run.start >= cfg.job.steps:
        return run
    run.client = PlannerClient(cfg.planner.url, token=cfg.planner.token, retry_seconds=cfg.planner.retry_seconds)
    try:
        run.client.wait_ready(cfg.planner.ready_timeout)
    except TimeoutError:
        raise TrainError(f"planner at {cfg.planner.url}: not reachable or not ready after {cfg.planner.ready_timeout:g} s "
                         "(check --planner.url and that `harts serve` is running)") from None
    if ctx.is_main:
        log.info("planner %s ready; training steps %d..%d of %d (%s, %d rank(s))", cfg.planner.url, run.start + 1,
                 cfg.job.steps, cfg.job.steps, cfg.parallelism.data_parallel, ctx.world_size)
    return run


def _build_model(cfg: TrainerConfig, ctx, *, init: bool):
    """(this rank's model, reshard_after_forward, full_param_grad_bytes): built on the meta
    device and sharded before any weight exists, so that no rank materialises the whole model
    under FSDP2 (`trainer.models.loading`).

    `init`: fill the weights from job.seed or the model directory; False leaves them for a checkpoint.
    """

    try:
        mcfg = model_config(cfg.model.name)
        full = full_param_grad_bytes(meta_model(mcfg))
        reshard = resolve_reshard(cfg.parallelism, full, ctx.device)
        _log_model_memory(cfg, ctx, mcfg, full, reshard)
        if cfg.parallelism.data_parallel == "fsdp":
            mesh = make_mesh(cfg.parallelism, ctx)
            model = build_model(cfg.model.name, seed=cfg.job.seed, device=ctx.device, fill=init,
                                shard=lambda m: parallelize(m, mesh, cfg.parallelism, ctx, reshard=reshard))
        else:  # full replicas: every rank builds them, rank 0's weights are broadcast
            model = build_model(cfg.model.name, seed=cfg.job.seed, device=ctx.device, fill=init)
            model = parallelize(model, None, cfg.parallelism, ctx)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    return model, reshard, full


def _log_model_memory(cfg: TrainerConfig, ctx, mcfg, full_bytes: int, reshard: bool) -> None:
    """Start-up lines on rank 0: the full parameters plus gradients and the schedule, then (FSDP2) the
    per-rank memory report of `plan.cluster_memory` for this model, world size, compute dtype and
    device memory (shards, gathered units, what is left for activations, whether it fits)."""
    if not ctx.is_main:
        return

    W, gib = ctx.world_size, float(1 << 30)
    fsdp = cfg.parallelism.data_parallel == "fsdp"
    log.info("model %s: full parameters + gradients %.3f GiB; per rank %s; parallelism.reshard_after_forward=%s%s",
             cfg.model.name, full_bytes / gib,
             f"{full_bytes / W / gib:.3f} GiB of shards" if fsdp else "a full replica",
             str(reshard).lower(), " (lock-step plans)" if reshard else "")
    if not fsdp:
        return
    dtype = str(param_dtype_of(cfg.parallelism, ctx.device)).removeprefix("torch.")
    memory_gb, source = _device_memory_gb(cfg.parallelism, ctx.device)
    head = cfg.executor.head if cfg.executor.head != "auto" else ("chunked" if ctx.device.type == "cuda" else "full")
    report = memory_report(mcfg.to_hf_dict(), W, dtype=dtype, device_memory_gb=memory_gb, lockstep=reshard,
                           model_name=cfg.model.name, chunk_size=cfg.executor.chunk_size, head=head,
                           activation_checkpointing=cfg.parallelism.activation_checkpointing,
                           expert_parallel=cfg.parallelism.expert_parallel)
    log.info("memory per rank (plan.cluster_memory, device memory %.1f GiB: %s):\n%s", memory_gb, source,
             "\n".join(report.lines()))


def _device_memory_gb(par, device) -> tuple[float, str]:
    """(memory of one device in GiB, where the figure comes from) for the memory report."""
    if par.device_memory_gb:
        return par.device_memory_gb, "parallelism.device_memory_gb"
    if device.type == "cuda":

        return torch.cuda.get_device_properties(device).total_memory / (1 << 30), f"{device} total memory"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 30), "host memory (CPU ranks)"


def _fetch(run: _Run, i: int):
    """Step i's plan slice for this rank (long-poll; checked for this step, rank and world size)."""

    sid, rank = run.cfg.step_id(i), run.ctx.rank
    timeout = run.cfg.planner.plan_timeout
    try:
        return run.client.fetch_plan(sid, rank, timeout=timeout, poll=min(30.0, timeout), world_size=run.ctx.world_size)
    except PlannerError as exc:
        raise TrainError(f"step {sid!r} rank {rank}: the planner answered {exc}") from None
    except TimeoutError as exc:
        raise TrainError(f"step {sid!r} rank {rank}: no plan after {timeout:g} s ({exc}; was the step "
                         "submitted and planned, and is the planner up?)") from None
    except WrongSliceError as exc:
        raise TrainError(f"step {sid!r} rank {rank}: {exc}") from None
    except ChecksumError as exc:
        raise TrainError(f"step {sid!r} rank {rank}: corrupted plan slice: {exc}") from None


def _loop(run: _Run) -> dict:
    """Steps start..job.steps: fetch (the next plan prefetched while one trains), train, log, save."""

    cfg, ctx = run.cfg, run.ctx
    try:
        run.writer = MetricsWriter(cfg.metrics, is_main=ctx.is_main,
                                   resume_step=run.start if cfg.checkpoint.resume else -1)
    except (OSError, ValueError) as exc:
        raise TrainError(f"metrics: {exc}") from None
    prefetch = _Prefetch(lambda i: _fetch(run, i), run.start)
    last: dict = {}
    for i in range(run.start, cfg.job.steps):
        sid = cfg.step_id(i)
        t_wait = time.perf_counter()
        plan = prefetch.get(i, run.stop)
        if plan is None:
            log.warning("SIGTERM while waiting for the plan of step %r: exiting after %d completed steps "
                        "(no new checkpoint)", sid, i)
            last["stopped"] = True
            break
        wait_seconds = time.perf_counter() - t_wait
        if i + 1 < cfg.job.steps:
            prefetch.start(i + 1)
        last, stopping = _train_step(plan, i, run)
        last["wait_seconds"] = wait_seconds
        done = i + 1
        if ctx.is_main:
            log.info("step %d/%d %s loss %.6f grad_norm %.4g lr %.3g tokens %d computed / %d expanded (%.2fx) "
                     "%.3f s %.0f tok/s%s", done, cfg.job.steps, sid, last["loss"], last["grad_norm"], last["lr"],
                     last["computed_tokens"], last["expanded_tokens"], last["compression"], last["seconds"],
                     last["tokens_per_s"], " (stale batch rejected)" if last.get("skipped") else "")
        run.writer.write(last)
        _save_and_export(cfg, ctx, run.model, run.opt, checkpoint, done, final=done == cfg.job.steps or stopping)
        if stopping:
            if ctx.is_main:
                log.warning("SIGTERM: stopped after step %d of %d", done, cfg.job.steps)
            break
    return last


def _train_step(plan, i: int, run: _Run) -> tuple[dict, bool]:
    """One step on this rank: run the slice, SUM-reduce gradients, clip, schedule the lr, AdamW.

    Returns:
        (metrics reduced over ranks, whether any rank has seen SIGTERM).
    """

    cfg, ctx, opt = run.cfg, run.ctx, run.opt
    sid = cfg.step_id(i)
    lockstep = plan.header.params.lockstep
    if run.reshard and not lockstep:  # every rank has the same header: all stop here, before any collective
        raise TrainError(f"step {sid!r}: parallelism.reshard_after_forward is true, which needs a lock-step plan, "
                         "got a free one; submit the step with topology.lockstep=true (`harts plan --lockstep`, "
                         "examples/generator_submit.py --lockstep) or set parallelism.reshard_after_forward=false")
    t0 = time.perf_counter()
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

        torch.cuda.reset_peak_memory_stats(ctx.device)
    res, grad_norm, n_mb = None, 0.0, len(plan.rank.microbatches)
    run.gauge.begin_step()
    if factor > 0:
        runner, work = run.executor, plan
        if not n_mb and not lockstep:  # a zero-loss stand-in keeps this rank in the collectives
            runner, work = run.stand_in, participation_slice(plan, conv_kernel=run.model.config.linear_conv_kernel_dim)
        try:
            res = run_slice(runner, work, run.sync)  # forward + backward of every microbatch
        except (ValueError, CrossRankError) as exc:
            raise TrainError(f"step {sid!r}: {exc}") from None
        run.sync.finish_step(run.params)
        run.gauge.sample()
        scale_grads(run.params, factor)
        grad_norm = grad_norm_and_clip(run.params, cfg.optimizer.max_grad_norm, ctx, sharded=run.sync.fsdp)
        opt.step()
    opt.zero_grad(set_to_none=True)
    out, stopping = _step_metrics(plan, i, run, res if n_mb or lockstep else None, seconds_since=t0)
    out.update(grad_norm=grad_norm, lr=lr, skipped=int(factor == 0))
    if factor == 0:
        out["tokens_per_s"] = 0.0
    if version is not None:
        out.update(batch_policy_version=version, staleness=staleness, staleness_scale=factor)
    return out, stopping


def _step_metrics(plan, i: int, run: _Run, res, *, seconds_since: float) -> tuple[dict, bool]:
    """The step's metrics summed / maxed / minned over ranks (collective), and whether any rank stops."""

    ctx = run.ctx
    real = res is not None
    stats = res.stats if real else {}
    adv = advantage_partials(plan)
    sums = [res.loss if real else 0.0, res.policy_loss if real else 0.0, res.kl if real else 0.0,
            res.aux_loss if real else 0.0, res.computed_tokens if real else 0, res.loss_tokens if real else 0.0,
            len(plan.rank.microbatches), res.windows if real else 0, res.recomputed_microbatches if real else 0,
            float(run.stop.requested), *adv[:3], res.standins if real else 0]
    sums += [float(stats.get(k, 0.0)) for k in STAT_SUMS] + [float(k in stats) for k in STAT_SUMS]
    maxes = [adv[3], peak_memory_mib(ctx.device), float(run.gauge.peak)] + [
        float(stats.get(k, float("-inf"))) for k in STAT_MAX]
    mins = [adv[4]] + [float(stats.get(k, float("inf"))) for k in STAT_MIN]
    sums = all_reduce_values(sums, ctx, "sum")
    maxes = all_reduce_values(maxes, ctx, "max")
    mins = all_reduce_values(mins, ctx, "min")
    loss, policy, kl, aux, computed, loss_tokens, mbs, windows, recomputed, stopping, an, asum, asq, standins = sums[:14]
    k = len(STAT_SUMS)
    stat_sums = {key: v for key, v, have in zip(STAT_SUMS, sums[14:14 + k], sums[14 + k:]) if have > 0}
    stat_max = {key: v for key, v in zip(STAT_MAX, maxes[3:]) if v != float("-inf")}
    stat_min = {key: v for key, v in zip(STAT_MIN, mins[1:]) if v != float("inf")}
    seconds = time.perf_counter() - seconds_since
    expanded = int(plan.header.stats.expanded_tokens) or int(
        unpack(plan.header.trajectory_lengths, "int32", name="trajectory_lengths").sum())
    out = {
        "step": i + 1, "step_id": run.cfg.step_id(i), "policy_version": i + 1, "loss": loss, "policy_loss": policy,
        "kl": kl, "aux_loss": aux, "grad_norm": 0.0, "lr": 0.0, "loss_tokens": loss_tokens,
        "computed_tokens": int(computed), "expanded_tokens": expanded,
        "compression": expanded / max(computed, 1.0), "microbatches": int(mbs), "windows": int(windows),
        "recomputed_microbatches": int(recomputed), "standins": int(standins), "seconds": seconds, "tokens_per_s": expanded / seconds,
        "computed_tokens_per_s": computed / seconds, "peak_memory_mib": maxes[1],
        "peak_param_grad_bytes": int(maxes[2]), "full_param_grad_bytes": run.full_bytes, "world_size": ctx.world_size,
        "skipped": 0,
    }
    if an > 0:
        out["advantage_mean"], out["advantage_std"] = moments(an, asum, asq)
        out["advantage_min"], out["advantage_max"] = mins[0], maxes[0]
    out.update(stat_metrics(stat_sums, stat_max, stat_min))
    out.update(reward_metrics(plan.header, gather=lambda v: all_reduce_values(v, ctx, "max")))
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
    """Write `<exports>/step-XXXXXXXX` (HF directory, policy_version = done) from rank 0, gathering
    one unit at a time; collective."""


    root = Path(cfg.checkpoint.exports)
    name = step_name(done)
    spec = Path(cfg.model.name)
    out = export_model(root / name, model, write=ctx.is_main, dtype=DTYPES[cfg.checkpoint.export_dtype],
                       meta={"policy_version": done, "step_ids": [cfg.step_id(j) for j in range(done)]},
                       files_from=spec if spec.is_dir() else None)
    if ctx.is_main:
        point_latest(root, name)
        prune(root, cfg.checkpoint.keep_last_exports)
        log.info("export %s (policy_version %d)", out, done)
    barrier(ctx)


def _meta(cfg: TrainerConfig, model, done: int) -> dict:
    config = to_dict(cfg)
    config["planner"].pop("token", None)  # never write the bearer token to disk
    return {"step_ids": [cfg.step_id(i) for i in range(done)], "model": cfg.model.name, "seed": cfg.job.seed,
            "lr": cfg.optimizer.lr, "model_config": model.config.to_hf_dict(), "config": config}


def _resume_path(cfg: TrainerConfig, checkpoint):
    """The newest checkpoint of checkpoint.dir, or None (a fresh start)."""
    try:
        path = checkpoint.latest(cfg.checkpoint.dir)
    except checkpoint.CheckpointError as exc:
        raise TrainError(f"--resume: {exc}") from None
    if path is None:
        log.info("--resume: no checkpoint in %s; starting at step 0", cfg.checkpoint.dir)
    return path


def _resume(cfg: TrainerConfig, path, model, opt, checkpoint) -> int:
    """Load the checkpoint at `path` into the (sharded) model and optimizer; returns its completed steps."""
    try:
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
