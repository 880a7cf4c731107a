"""Test helpers for runs of several processes on gloo, and for comparing their gradients.

    out = spawn_ranks(worker, world, (plan_bytes,))  # worker(rank, world, port, plan_bytes, queue)
    rel = rel_grad_diff(grads, reference)            # ||a - b|| / ||b|| over every parameter
    assert_ranks_match(out, grads, loss, "2 ranks")  # every rank's full gradients, the summed loss

A worker puts `(rank, result)` on the queue it is given. By default every rank must report and
exit 0, and a rank that fails stops the others (they would wait in a collective); with
`want=k, kill=True` the first k reports are enough and the rest are killed (failure tests).
"""
from __future__ import annotations

import queue as queue_mod
import socket
import time

import numpy as np
import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, args: tuple, *, want: int | None = None, kill: bool = False,
                timeout: float = 300.0) -> dict:
    """Start `world` spawned processes `target(rank, world, port, *args, queue)`; rank -> result.

    Args:
        want: reports to wait for (default: every rank).
        kill: kill the ranks once `want` have reported (they may die or hang on purpose); without
            it a rank that exits non-zero fails the test.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < (world if want is None else want):
            try:
                rank, got = queue.get(timeout=2)
                out[rank] = got
            except queue_mod.Empty:
                if (not kill and any(p.exitcode not in (None, 0) for p in procs)) or time.monotonic() > deadline:
                    kill = True
                    pytest.fail(f"a rank failed or hung (exit codes {[p.exitcode for p in procs]}); see its traceback above")
    finally:
        if kill:
            for p in procs:
                p.kill()
        for p in procs:
            p.join(30)
    if want is None:
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def rel_grad_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """||a - b|| / ||b|| over all parameters' gradients (float64), the same names required."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = sum(float(np.square(np.asarray(a[k], np.float64) - b[k]).sum()) for k in a)
    den = sum(float(np.square(np.asarray(b[k], np.float64)).sum()) for k in a)
    return (num / den) ** 0.5


def assert_ranks_match(out: dict, want: dict[str, np.ndarray], loss: float, label: str, *, tol: float = 1e-6) -> None:
    """Every rank's reported full gradients (`out[rank]["grads"]`) within `tol` of `want` (relative,
    printed), and the ranks' losses (`out[rank]["loss"]`) summing to `loss`."""
    for rank in sorted(out):
        rel = rel_grad_diff(out[rank]["grads"], want)
        print(f"{label}, rank {rank}: relative gradient difference {rel:.3g}")
        assert rel <= tol, (rank, rel)
    assert abs(sum(o["loss"] for o in out.values()) - loss) <= tol * max(1.0, abs(loss))
