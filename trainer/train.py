"""Trainer entry point: each torchrun rank long-polls its plan slices from the planner and trains (DESIGN §5.7).

    torchrun --nproc_per_node=2 -m trainer.train --planner-url http://planner:8000 --token "$HARTS_TOKEN" \\
        --steps 3 --step-prefix step- --model tiny --chunk-size 64 \\
        --checkpoint-dir /ckpt --checkpoint-every 1 --resume --metrics-jsonl /ckpt/metrics.jsonl

    python -m trainer.train ...          # one process: world size 1 (no torchrun needed)
    harts train ...                      # the same CLI; --nproc-per-node N launches torchrun itself

Step i (0-based) trains the planner step `--step-ids`[i], or `<step-prefix><i>` (`harts gen`
names batches `step-0`, `step-1`, ...). Every rank builds the model from `--seed` and then takes
rank 0's weights (a broadcast), long-polls its own slice of the step's plan (the next step's
slice is fetched in the background while the current one trains), runs it with the executor
(forward + backward per microbatch, no communication), SUM-reduces the gradients once (see
`trainer.distributed` for why SUM), optionally clips them, steps AdamW and logs one metrics line
from rank 0 (also appended to `--metrics-jsonl`). The plan's world size must equal torchrun's,
and its chunk size, conv kernel and vocabulary the model's. Checkpoints (DCP: model, optimizer,
step) go to `--checkpoint-dir` every `--checkpoint-every` steps and after the last one;
`--resume` continues from the newest one. SIGTERM (on any rank) finishes the current step,
checkpoints and exits 0 (a rank still waiting for a plan exits at once, keeping the previous
checkpoint: a collective save cannot start while another rank computes). Errors (planner
unreachable, a plan for another topology, vocabulary or chunk size) print one line per rank and
exit 1.

Metrics per step: loss (the step's total, summed over ranks), computed_tokens (rows run, replay
included, all ranks), expanded_tokens (the trajectory-expanded batch), compression
(expanded / computed), seconds (execute + sync + optimizer, without waiting for the plan),
wait_seconds (waiting for the plan), tokens_per_s (expanded tokens per second: update throughput).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("trainer.train")

__all__ = ["TrainConfig", "TrainError", "train", "add_arguments", "config_from_args", "main"]


class TrainError(Exception):
    """A failure the user can act on (shown as one line, no traceback)."""


@dataclass(slots=True, kw_only=True)
class TrainConfig:
    """One training run of the trainer client."""

    planner_url: str
    """Base URL of the planner service's HTTP API."""
    steps: int
    """Total number of steps of the run (a resumed run continues up to this count)."""
    token: str | None = None
    """Bearer token of the planner (None: no Authorization header)."""
    step_prefix: str = "step-"
    """Step i is `<step_prefix><i>` unless step_ids is given."""
    step_ids: list[str] = field(default_factory=list)
    """Explicit planner step ids, one per step (at least `steps` of them)."""
    model: str = "tiny"
    """A named config (tiny, tiny-dense, tiny-deep, small: random weights from `seed`) or a Hugging Face directory."""
    seed: int = 0
    """Seed of the random weights (every rank then takes rank 0's)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this (0: no clipping; the norm is logged either way)."""
    backend: str = "ref"
    """Gated delta rule kernel backend: "ref" (PyTorch) or "triton"."""
    chunk_size: int = 64
    """Linear-attention kernel chunk size C; the plans must be made for it."""
    checkpoint_dir: str | None = None
    """Where DCP checkpoints go (None: no checkpoints)."""
    checkpoint_every: int = 0
    """Checkpoint every K completed steps (0: only after the last step)."""
    resume: bool = False
    """Continue from the newest checkpoint in checkpoint_dir (a fresh start when there is none)."""
    metrics_jsonl: str | None = None
    """Rank 0 appends one JSON line of metrics per step here."""
    plan_timeout: float = 600.0
    """Seconds to wait for one step's plan slice (long-poll)."""
    ready_timeout: float = 120.0
    """Seconds to wait for the planner to answer /readyz at start-up."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if self.step_ids and len(self.step_ids) < self.steps:
            raise ValueError(f"step_ids: expected at least steps={self.steps} ids, got {len(self.step_ids)}")
        if any(not s for s in self.step_ids):
            raise ValueError(f"step_ids: expected non-empty ids, got {self.step_ids}")
        if self.lr <= 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: expected >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0, got {self.checkpoint_every}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume: expected a checkpoint_dir to resume from, got none; pass --checkpoint-dir")
        if self.plan_timeout <= 0 or self.ready_timeout <= 0:
            raise ValueError(f"plan_timeout/ready_timeout: expected > 0, got {self.plan_timeout}, {self.ready_timeout}")

    def step_id(self, i: int) -> str:
        return self.step_ids[i] if self.step_ids else f"{self.step_prefix}{i}"


def train(cfg: TrainConfig) -> dict:
    """Run the training loop on this rank; returns the last step's metrics (rank 0's view).

    Side effects: joins (and finally leaves) the torchrun process group, handles SIGTERM while it
    runs, writes checkpoints and metrics.
    Raises:
        TrainError: planner unreachable, a plan this rank cannot run, a checkpoint of another run.
    """
    # torch and the model are imported here, not at the top, so that `harts --help` stays fast.
    import torch

    from trainer import checkpoint
    from trainer.client import ChecksumError, PlannerClient, PlannerError, RetryPolicy
    from trainer.distributed import broadcast_parameters, init_distributed, shutdown
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model
    from trainer.optim import make_optimizer

    stop = _StopFlag()
    stop.install()
    ctx = init_distributed()
    prefix = f"[rank {ctx.rank}/{ctx.world_size}] "
    client = None
    try:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, seed=cfg.seed).to(ctx.device)
        broadcast_parameters(model, ctx)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        executor = Executor(model, ExecutorConfig(chunk_size=cfg.chunk_size, backend=cfg.backend))

        start = 0
        if cfg.resume:
            start = _resume(cfg, model, opt, checkpoint)
        if start >= cfg.steps:
            log.info("checkpoint already has %d of %d steps; nothing to do", start, cfg.steps)
            return {"step": start}

        client = PlannerClient(cfg.planner_url, token=cfg.token, retry=RetryPolicy(attempts=4, backoff_s=0.2))
        try:
            client.wait_ready(cfg.ready_timeout)
        except TimeoutError:
            raise TrainError(f"planner at {cfg.planner_url}: not reachable or not ready after {cfg.ready_timeout:g} s "
                             "(check --planner-url and that `harts serve` is running)") from None
        if ctx.is_main:
            log.info("planner %s ready; training steps %d..%d of %d", cfg.planner_url, start + 1, cfg.steps, cfg.steps)

        def fetch(i: int):
            sid = cfg.step_id(i)
            try:
                return client.fetch_plan(sid, ctx.rank, timeout=cfg.plan_timeout, poll=min(30.0, cfg.plan_timeout))
            except PlannerError as exc:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: the planner answered {exc}") from None
            except TimeoutError:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: no plan after {cfg.plan_timeout:g} s "
                                 "(was the step submitted and planned?)") from None
            except ChecksumError as exc:
                raise TrainError(f"step {sid!r} rank {ctx.rank}: corrupted plan slice: {exc}") from None

        metrics_file = open(cfg.metrics_jsonl, "a") if cfg.metrics_jsonl and ctx.is_main else None
        prefetch = _Prefetch(fetch, start)
        last: dict = {}
        try:
            for i in range(start, cfg.steps):
                sid = cfg.step_id(i)
                t_wait = time.perf_counter()
                plan = prefetch.get(i, stop)
                if plan is None:
                    log.warning("SIGTERM while waiting for the plan of step %r: exiting after %d completed steps "
                                "(no new checkpoint)", sid, i)
                    last["stopped"] = True
                    break
                wait_seconds = time.perf_counter() - t_wait
                if i + 1 < cfg.steps:
                    prefetch.start(i + 1)
                last, stopping = _train_step(plan, i, cfg, ctx, executor, params, opt, stop)
                last["wait_seconds"] = wait_seconds
                done = i + 1
                if ctx.is_main:
                    log.info("step %d/%d %s loss %.6f grad_norm %.4g tokens %d computed / %d expanded (%.2fx) "
                             "%.3f s %.0f tok/s", done, cfg.steps, sid, last["loss"], last["grad_norm"],
                             last["computed_tokens"], last["expanded_tokens"], last["compression"], last["seconds"],
                             last["tokens_per_s"])
                    if metrics_file is not None:
                        metrics_file.write(json.dumps(last) + "\n")
                        metrics_file.flush()
                every = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                if cfg.checkpoint_dir and (every or done == cfg.steps or stopping):
                    path = checkpoint.save(cfg.checkpoint_dir, step=done, model=model, optimizer=opt,
                                           meta=_meta(cfg, done), ctx=ctx)
                    if ctx.is_main:
                        log.info("checkpoint %s", path)
                if stopping:
                    if ctx.is_main:
                        log.warning("SIGTERM: stopped after step %d of %d", done, cfg.steps)
                    break
        finally:
            if metrics_file is not None:
                metrics_file.close()
        return last
    except TrainError as exc:
        raise TrainError(prefix + str(exc)) from None
    finally:
        stop.uninstall()
        if client is not None:
            client.close()
        shutdown(ctx)


def _train_step(plan, i: int, cfg: TrainConfig, ctx, executor, params, opt, stop: "_StopFlag") -> tuple[dict, bool]:
    """One step on this rank: run the slice, SUM-sync gradients, clip, AdamW.

    Returns:
        (metrics reduced over ranks, whether any rank has seen SIGTERM).
    """
    from trainer.distributed import all_reduce_values, sync_gradients

    sid = cfg.step_id(i)
    t0 = time.perf_counter()
    _check_slice(plan, sid, ctx)
    try:
        res = executor.run_step(plan)  # forward + backward of every microbatch, no communication
    except ValueError as exc:
        raise TrainError(f"step {sid!r}: {exc}") from None
    sync_gradients(params, ctx)
    grad_norm = _clip(params, cfg.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss, policy, kl, computed, loss_tokens, n_mb, stopping = all_reduce_values(
        [res.loss, res.policy_loss, res.kl, res.computed_tokens, res.loss_tokens, res.microbatches,
         float(stop.requested)], ctx)
    seconds = time.perf_counter() - t0
    return {
        "step": i + 1, "step_id": sid, "loss": loss, "policy_loss": policy, "kl": kl, "grad_norm": grad_norm,
        "computed_tokens": int(computed), "expanded_tokens": res.expanded_tokens,
        "compression": res.expanded_tokens / max(computed, 1.0), "loss_tokens": loss_tokens,
        "microbatches": int(n_mb), "seconds": seconds, "tokens_per_s": res.expanded_tokens / seconds,
        "computed_tokens_per_s": computed / seconds, "lr": cfg.lr, "world_size": ctx.world_size,
    }, stopping > 0


def _check_slice(plan, sid: str, ctx) -> None:
    """The plan must be made for this topology and this rank."""
    ws = plan.header.params.world_size
    if ws != ctx.world_size:
        raise TrainError(f"step {sid!r}: the plan is for world_size={ws}, but this run has {ctx.world_size} "
                         f"rank(s); launch torchrun with --nproc_per_node={ws} (x nodes) or re-plan the step")
    if plan.rank.rank != ctx.rank:
        raise TrainError(f"step {sid!r}: expected the slice of rank {ctx.rank}, got rank {plan.rank.rank}")


def _clip(params, max_norm: float) -> float:
    """Global gradient norm (before clipping); clips in place when max_norm > 0."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _meta(cfg: TrainConfig, done: int) -> dict:
    return {"step_ids": [cfg.step_id(i) for i in range(done)], "model": cfg.model, "seed": cfg.seed, "lr": cfg.lr}


def _resume(cfg: TrainConfig, model, opt, checkpoint) -> int:
    """Load the newest checkpoint; returns the number of completed steps (0 without one)."""
    try:
        path = checkpoint.latest(cfg.checkpoint_dir)
        if path is None:
            log.info("--resume: no checkpoint in %s; starting at step 0", cfg.checkpoint_dir)
            return 0
        meta = checkpoint.read_meta(path)
        done = int(meta["step"])
        want = [cfg.step_id(i) for i in range(min(done, cfg.steps))]
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
    """The trainer's flags (shared by `python -m trainer.train` and `harts train`)."""
    env = os.environ.get
    p.add_argument("--planner-url", default=env("HARTS_PLANNER_URL", "http://127.0.0.1:8000"),
                   help="planner HTTP base URL (env HARTS_PLANNER_URL)")
    p.add_argument("--token", default=env("HARTS_TOKEN") or None, help="bearer token (env HARTS_TOKEN)")
    p.add_argument("--steps", type=int, required=True, help="total number of steps of the run")
    ids = p.add_mutually_exclusive_group()
    ids.add_argument("--step-prefix", default="step-", help="step i is PREFIX<i> (default: step-)")
    ids.add_argument("--step-ids", default="", help="comma-separated planner step ids, one per step")
    p.add_argument("--model", default="tiny", help="named config (tiny, tiny-dense, tiny-deep, small) or a Qwen3-Next HF directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=0.0, help="clip the gradient norm (0: off)")
    p.add_argument("--backend", default="ref", choices=["ref", "triton"], help="gated delta rule kernel backend")
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size C (plans must match)")
    p.add_argument("--checkpoint-dir", default=None, help="DCP checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--metrics-jsonl", default=None, help="rank 0 appends one JSON line per step here")
    p.add_argument("--plan-timeout", type=float, default=600.0, help="seconds to wait for a step's plan")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for the planner at start-up")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        planner_url=args.planner_url, token=args.token, steps=args.steps, step_prefix=args.step_prefix,
        step_ids=[s.strip() for s in args.step_ids.split(",") if s.strip()], model=args.model, seed=args.seed,
        lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, backend=args.backend,
        chunk_size=args.chunk_size, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, metrics_jsonl=args.metrics_jsonl, plan_timeout=args.plan_timeout,
        ready_timeout=args.ready_timeout,
    )


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
    except (TrainError, ValueError) as exc:
        print(f"trainer.train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s", stream=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
