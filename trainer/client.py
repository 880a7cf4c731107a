"""HTTP client of the planner service, for rollout generators and trainer ranks.

It depends on the wire contract (`proto/`) only, never on `planner_service`. Connection errors
and 5xx answers are retried with exponential backoff and jitter; 4xx answers raise
`PlannerError` at once (they will not get better). Fetched plan slices are verified with
`proto.plan_io.open_sealed` and against the `X-Harts-Checksum` header; a corrupted slice is fetched
again, then refused.

    from trainer.client import PlannerClient
    client = PlannerClient("http://planner:8000", token=os.environ.get("HARTS_TOKEN"))
    client.submit(doc, world_size=2, microbatch_tokens=4096)       # generator
    slice_ = client.fetch_plan("step-0", rank, timeout=600)        # trainer rank: long-polls

Command line (the compose demo generator uses it):

    python -m trainer.client --url http://127.0.0.1:8000 submit rollouts.json --world-size 2
    python -m trainer.client --url http://127.0.0.1:8000 fetch step-0 0 -o rank0.pb
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from proto.harts.v1 import plan_pb2, rollouts_pb2
from proto.plan_io import ChecksumError, open_sealed

log = logging.getLogger(__name__)

__all__ = ["PlannerClient", "PlannerError", "RetryPolicy", "ChecksumError"]

PROTOBUF = "application/x-protobuf"


class PlannerError(Exception):
    """An error answer of the service (or retries exhausted).

    Attributes:
        status: HTTP status (0 when the service could not be reached).
        code: gRPC-style code name from the error body (INVALID_ARGUMENT, NOT_FOUND...).
        field: first offending field, when the service names one.
    """

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.field = status, code, message, field


@dataclass(slots=True, kw_only=True)
class RetryPolicy:
    """Retries of transient failures (connection errors, 5xx, corrupted plan slices)."""

    attempts: int = 8
    """Tries per call, the first included (>= 1)."""
    backoff_s: float = 0.1
    """Sleep before the first retry; doubles each time."""
    max_backoff_s: float = 5.0
    """Cap of one sleep."""
    jitter: float = 0.25
    """Each sleep is scaled by a uniform factor in [1 - jitter, 1 + jitter]."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: expected >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"backoff_s: expected 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter: expected in [0, 1), got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (1-based)."""
        base = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


class PlannerClient:
    """Synchronous client of the planner's HTTP API.

    Args:
        url: base URL, e.g. http://127.0.0.1:8000.
        token: bearer token (None: no Authorization header).
        timeout: seconds per request (a long-poll adds its wait on top).
        retry: retry policy for transient failures.
        transport: httpx transport override (tests inject failures with it).
    """

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 retry: RetryPolicy | None = None, transport: httpx.BaseTransport | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "PlannerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw) -> httpx.Response:
        """One call with retries on connection errors and 5xx; raises PlannerError on 4xx."""
        last: Exception | None = None
        for attempt in range(1, self.retry.attempts + 1):
            if attempt > 1:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                resp = self._http.request(method, path, timeout=timeout or self.timeout, **kw)
            except httpx.TransportError as exc:
                last = exc
                log.warning("%s %s: %s (attempt %d/%d)", method, path, type(exc).__name__, attempt, self.retry.attempts)
                continue
            if resp.status_code >= 500:
                last = _error_of(resp)
                log.warning("%s %s: %s (attempt %d/%d)", method, path, last, attempt, self.retry.attempts)
                continue
            if resp.status_code >= 400:
                raise _error_of(resp)
            return resp
        if isinstance(last, PlannerError):
            raise last
        raise PlannerError(0, "UNAVAILABLE", f"{method} {path}: no answer after {self.retry.attempts} attempts ({last!r})")

    # ---- operations

    def healthy(self) -> bool:
        """True when /readyz answers 200 (one try, no retries)."""
        try:
            return self._http.get("/readyz", timeout=min(self.timeout, 5.0)).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Block until the service is ready; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"planner at {self._http.base_url} not ready after {timeout} s")
            time.sleep(interval)

    def submit(self, batch: dict | rollouts_pb2.RolloutBatch | bytes, *, content_type: str = "application/json",
               **topology) -> dict:
        """Submit a step's rollouts (idempotent by batch_id: retrying is always safe).

        Args:
            batch: the JSON document (dict), a RolloutBatch message (sent as protobuf), or body bytes
                of `content_type`.
            topology: world_size, microbatch_tokens, memory_tokens, chunk_size, no_sharing,
                no_windows: plan at once for this topology.

        Returns:
            {"status": {...}, "duplicate": bool}.
        """
        if isinstance(batch, dict):
            body = json.dumps(batch, separators=(",", ":")).encode()
        elif isinstance(batch, rollouts_pb2.RolloutBatch):
            body, content_type = batch.SerializeToString(deterministic=True), PROTOBUF
        else:
            body = bytes(batch)
        params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in topology.items() if v is not None}
        resp = self._request("POST", "/v1/steps", content=body, params=params, headers={"Content-Type": content_type})
        return resp.json()

    def plan(self, step_id: str, *, world_size: int, **topology) -> dict:
        """Plan a stored step for a topology; returns its status."""
        return self._request("POST", f"/v1/steps/{step_id}/plan", json={"world_size": world_size, **topology}).json()

    def status(self, step_id: str) -> dict:
        return self._request("GET", f"/v1/steps/{step_id}").json()

    def list_steps(self, limit: int = 0) -> list[dict]:
        return self._request("GET", "/v1/steps", params={"limit": limit}).json()["steps"]

    def fetch_plan_bytes(self, step_id: str, rank: int, *, timeout: float = 600.0, poll: float = 30.0) -> bytes:
        """Sealed slice bytes of `rank`, long-polling until planned; verified before returning.

        Raises:
            TimeoutError: not planned within `timeout` seconds.
            PlannerError: planning failed, unknown rank, auth... (not retried).
            ChecksumError: every attempt returned a corrupted slice.
        """
        deadline = time.monotonic() + timeout
        corrupt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"plan of step {step_id!r} rank {rank} not ready after {timeout} s")
            wait = max(0.0, min(poll, remaining))
            try:
                resp = self._request("GET", f"/v1/steps/{step_id}/ranks/{rank}/plan", params={"wait": wait},
                                     timeout=self.timeout + wait)
            except PlannerError as exc:
                not_ready = exc.code == "DEADLINE_EXCEEDED" or (exc.code == "NOT_FOUND" and not exc.message.startswith("rank:"))
                if exc.status == 404 and not_ready:
                    continue
                raise
            data = resp.content
            try:
                slice_ = open_sealed(data)
                header = resp.headers.get("X-Harts-Checksum")
                if header is not None and header != slice_.checksum:
                    raise ChecksumError(f"X-Harts-Checksum: expected {slice_.checksum}, got {header}")
            except ChecksumError as exc:
                corrupt += 1
                log.warning("step %s rank %d: %s (attempt %d/%d)", step_id, rank, exc, corrupt, self.retry.attempts)
                if corrupt >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(corrupt))
                continue
            return data

    def fetch_plan(self, step_id: str, rank: int, *, timeout: float = 600.0, poll: float = 30.0) -> plan_pb2.PlanSlice:
        """`fetch_plan_bytes`, parsed (already verified)."""
        return open_sealed(self.fetch_plan_bytes(step_id, rank, timeout=timeout, poll=poll))


def _error_of(resp: httpx.Response) -> PlannerError:
    try:
        err = resp.json()["error"]
        return PlannerError(resp.status_code, str(err.get("code", "")), str(err.get("message", "")), err.get("field"))
    except (ValueError, KeyError, TypeError):
        return PlannerError(resp.status_code, "UNKNOWN", resp.text[:200])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.client", description="Planner service client.")
    p.add_argument("--url", default=os.environ.get("HARTS_PLANNER_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("HARTS_TOKEN") or None)
    p.add_argument("--wait-ready", type=float, default=120.0, help="seconds to wait for the service first")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="submit a rollout file (.json document or .pb RolloutBatch)")
    s.add_argument("path")
    for name in ("world-size", "microbatch-tokens", "memory-tokens", "chunk-size"):
        s.add_argument(f"--{name}", type=int, default=None)
    f = sub.add_parser("fetch", help="fetch and verify one rank's plan slice")
    f.add_argument("step_id")
    f.add_argument("rank", type=int)
    f.add_argument("--timeout", type=float, default=600.0)
    f.add_argument("-o", "--out", help="write the sealed bytes here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    with PlannerClient(args.url, token=args.token) as client:
        client.wait_ready(args.wait_ready)
        if args.cmd == "submit":
            data = Path(args.path).read_bytes()
            ctype = PROTOBUF if args.path.endswith(".pb") else "application/json"
            topo = {k: getattr(args, k) for k in ("world_size", "microbatch_tokens", "memory_tokens", "chunk_size")}
            out = client.submit(data, content_type=ctype, **topo)
        else:
            data = client.fetch_plan_bytes(args.step_id, args.rank, timeout=args.timeout)
            if args.out:
                Path(args.out).write_bytes(data)
            sl = open_sealed(data)
            out = {"step_id": sl.header.step_id, "rank": sl.rank.rank, "microbatches": len(sl.rank.microbatches),
                   "checksum": sl.checksum, "bytes": len(data)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (PlannerError, TimeoutError, ChecksumError, OSError) as exc:
        print(f"trainer.client: error: {exc}", file=sys.stderr)
        sys.exit(1)
