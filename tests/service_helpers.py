"""Shared helpers of the planner-service tests: small rollout documents, a loopback server under
chosen limits, raw HTTP requests."""
from __future__ import annotations

import numpy as np

TOPOLOGY = {"world_size": 2, "microbatch_tokens": 128, "chunk_size": 16}
"""A topology small enough to plan in milliseconds."""


def rollout_doc(batch_id: str, *, seed: int = 0, trajectories: int = 6, vocab: int = 64) -> dict:
    """A flat rollout document: `trajectories` rollouts of 30-90 tokens sharing a 24-token prompt
    (two groups that also share a few turns), with loss masks, old log-probs and advantages."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 24).tolist()
    turns = [rng.integers(0, vocab, int(rng.integers(4, 20))).tolist() for _ in range(2)]
    out = []
    for i in range(trajectories):
        tail = rng.integers(0, vocab, int(rng.integers(6, 60))).tolist()
        tokens = prompt + turns[i % 2] + tail
        mask = [0] * (len(prompt) + len(turns[i % 2])) + [1] * len(tail)
        out.append({
            "id": f"{batch_id}-t{i}",
            "tree_id": "task-0",
            "tokens": tokens,
            "loss_mask": mask,
            "old_logprobs": np.round(-rng.random(len(tokens)), 4).tolist(),
            "advantage": float(np.round(rng.normal(), 4)),
            "group_id": "g0",
        })
    return {"batch_id": batch_id, "vocab_size": vocab, "trajectories": out}


class LiveServer:
    """`harts serve` on 127.0.0.1 with OS-chosen ports, started by `start_serve`."""

    def __init__(self, proc, log_path, http_url: str, grpc_target: str):
        self.proc, self.log_path, self.http_url, self.grpc_target = proc, log_path, http_url, grpc_target
        host, port = http_url.removeprefix("http://").rsplit(":", 1)
        self.http_addr = (host, int(port))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def start_serve(db, log_path, *, extra=(), nofile: int | None = None, env=None, timeout: float = 600.0) -> LiveServer:
    """Start `harts serve` as a subprocess, optionally under a file-descriptor limit (soft = hard
    = `nofile`, as `ulimit -n` in a container), and return once its HTTP port accepts.

    It waits for the first line naming the ports (`listening` or `ready`), then for a TCP connect
    to succeed, so that it works whatever that line promises. `timeout` only catches a server that
    never starts: a first start compiles the Numba code (over 90 s on a loaded 2-core machine).
    """
    import os
    import re
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    def limit() -> None:
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "harts_cli.main", "serve", "--host", "127.0.0.1", "--http-port", "0",
           "--grpc-port", "0", "--db", str(db), *extra]
    full_env = {k: v for k, v in os.environ.items() if k != "HARTS_TOKEN"}
    full_env.update(env or {})
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=full_env, preexec_fn=limit)
    pattern = re.compile(r"harts serve: (?:listening|ready) http=(\S+) grpc=(\S+)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = pattern.search(Path(log_path).read_text(errors="replace"))
        if m:
            srv = LiveServer(proc, Path(log_path), m.group(1), m.group(2))
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(srv.http_addr, timeout=1).close()
                    return srv
                except OSError:
                    time.sleep(0.02)
            break
        if proc.poll() is not None:
            raise RuntimeError(f"harts serve exited with {proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"harts serve not accepting after {timeout} s:\n{Path(log_path).read_text()[-3000:]}")


def raw_request(addr, data: bytes, *, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send raw bytes on a new connection and read until the server closes it or `timeout` passes.

    Returns:
        (everything received, seconds until the server closed the connection or the timeout).
    """
    import socket
    import time

    t0 = time.perf_counter()
    with socket.create_connection(addr, timeout=timeout) as s:
        s.sendall(data)
        got = b""
        s.settimeout(timeout)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got, time.perf_counter() - t0


def status_line(response: bytes) -> str:
    return response.split(b"\r\n", 1)[0].decode("latin-1")
