"""HTTP client of the planner service, for rollout generators and trainer ranks.

    client = PlannerClient("http://planner-a:8000,http://planner-b:8000", token=os.environ.get("HARTS_TOKEN"))
    client.submit(doc, world_size=2, microbatch_tokens=4096)       # generator
    slice_ = client.fetch_plan("step-0", rank, timeout=600)        # trainer rank: long-polls
    python -m harts_client.client --url http://127.0.0.1:8000 fetch step-0 0 -o rank0.pb

Depends on `proto/` and `plan/` only. Retries within the caller's deadline, failover over
replicas, verified slices and submissions: docs/design/training-loop.md ("The client").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from proto.harts.v1 import plan_pb2, rollouts_pb2
from plan.seal import ChecksumError, open_sealed

log = logging.getLogger(__name__)

__all__ = ["PlannerClient", "PlannerError", "IntegrityError", "RetryPolicy", "ChecksumError", "WrongSliceError",
           "planner_urls"]

PROTOBUF = "application/x-protobuf"
BODY_SHA256_HEADER = "X-Harts-Body-Sha256"
"""The SHA-256 of a submission's body, sent with it and compared with the answer's `body_sha256`."""
_MAX_RETRY_AFTER_S = 30.0
_ANSWER_MARGIN_S = 0.5
"""A long-poll asks the server to answer this long before the caller's deadline."""
_BAD_SLICE_ATTEMPTS = 8
"""Fetches of a corrupted or misdirected slice (or submissions whose digest does not match) at
most, when the retry policy sets no cap."""


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


class IntegrityError(PlannerError):
    """A submission whose bytes, or whose answer, kept arriving altered (`body_sha256`)."""

    def __init__(self, message: str):
        super().__init__(0, "DATA_LOSS", message)


class WrongSliceError(ChecksumError):
    """A sealed slice that is intact but not the one asked for (another step, rank or world size)."""

    final = False
    """True when fetching again cannot help (a plan for another world size)."""


@dataclass(slots=True, kw_only=True)
class RetryPolicy:
    """Retries of transient failures (connection errors, 5xx, corrupted plan slices)."""

    attempts: int = 0
    """Tries per call at most, the first included; 0: no cap, a call retries until its deadline."""
    backoff_s: float = 0.1
    """Sleep before the first retry; doubles each time."""
    max_backoff_s: float = 5.0
    """Cap of one sleep."""
    jitter: float = 0.25
    """Each sleep is scaled by a uniform factor in [1 - jitter, 1 + jitter]."""

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"attempts: expected >= 0 (0: until the deadline), got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"backoff_s: expected 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter: expected in [0, 1), got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (1-based)."""
        base = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


def planner_urls(url: str | Sequence[str]) -> list[str]:
    """Base URLs from a list or a comma-separated string, trailing slashes dropped; ValueError
    when there is none."""
    parts = url.split(",") if isinstance(url, str) else list(url)
    urls = [u.strip().rstrip("/") for u in parts if u.strip()]
    if not urls:
        raise ValueError(f"url: expected one or more planner base URLs such as http://127.0.0.1:8000, got {url!r}")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"url: expected http:// or https:// URLs, got {bad[0]!r}")
    return urls


class PlannerClient:
    """Synchronous client of the planner's HTTP API.

    Args:
        url: base URL, e.g. http://127.0.0.1:8000, or several (a list, or commas) of replicas
            that share one database: the client fails over between them.
        token: bearer token (None: no Authorization header).
        timeout: seconds a call may take in all, retries and their sleeps included (each operation
            can override it; `fetch_plan` has its own).
        retry: retry policy for transient failures.
        retry_seconds: longest outage (no answer from any URL) a long-poll rides out, even past
            its timeout; None: only until the call's deadline.
        transport: httpx transport override (tests inject failures with it).
    """

    def __init__(self, url: str | Sequence[str], *, token: str | None = None, timeout: float = 30.0,
                 retry: RetryPolicy | None = None, retry_seconds: float | None = None,
                 transport: httpx.BaseTransport | None = None):
        if retry_seconds is not None and not (retry_seconds >= 0 and math.isfinite(retry_seconds)):
            raise ValueError(f"retry_seconds: expected a finite number >= 0 or None, got {retry_seconds!r}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.urls = planner_urls(url)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.retry_seconds = retry_seconds
        self._current = 0
        self._warned_no_digest = False
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport)

    @property
    def url(self) -> str:
        """The base URL the client talks to now (the last one that answered)."""
        return self.urls[self._current]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "PlannerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing

    def _request(self, method: str, path: str, *, deadline: float | None = None, wait: float = 0.0,
                 **kw) -> httpx.Response:
        """One call, retried on connection errors and 5xx (the next URL at once, then with backoff
        once every URL has failed in a row) until `deadline` (time.monotonic(); default: `timeout`
        from now) or the policy's attempts; raises PlannerError on 4xx, and on 5xx or no answer
        when the attempts or the time run out. `wait` is a long-poll's server-side wait (not
        retried on top)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        start = time.monotonic()
        last: Exception | None = None
        pause = 0.0
        attempt = failed_in_row = 0
        cap = self.retry.attempts
        while not cap or attempt < cap:
            if failed_in_row and failed_in_row % len(self.urls) == 0:
                pause = max(pause, self.retry.delay(failed_in_row // len(self.urls)))
                if time.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            base = self.url
            try:
                resp = self._http.request(method, base + path, timeout=min(self.timeout + wait, remaining), **kw)
            except httpx.TransportError as exc:
                last, pause = exc, 0.0
                failed_in_row += 1
                self._failover()
                log.warning("%s %s%s: %s (attempt %d)", method, base, path, type(exc).__name__, attempt)
                continue
            if resp.status_code >= 500:
                last, pause = _error_of(resp), _retry_after(resp)
                failed_in_row += 1
                self._failover()
                log.warning("%s %s%s: %s (attempt %d)", method, base, path, last, attempt)
                continue
            if resp.status_code >= 400:
                raise _error_of(resp)
            return resp
        if isinstance(last, PlannerError):
            raise last
        where = ", ".join(self.urls)
        raise PlannerError(0, "UNAVAILABLE", f"{method} {path}: no answer from {where} for "
                           f"{time.monotonic() - start:.0f} s ({attempt} attempt(s); last: {last!r})")

    def _failover(self) -> None:
        self._current = (self._current + 1) % len(self.urls)

    # ---- operations

    def healthy(self) -> bool:
        """True when /readyz of some URL answers 200 (one try each, no retries); the client then
        talks to that one."""
        for i in range(len(self.urls)):
            k = (self._current + i) % len(self.urls)
            try:
                if self._http.get(self.urls[k] + "/readyz", timeout=min(self.timeout, 5.0)).status_code == 200:
                    self._current = k
                    return True
            except httpx.TransportError:
                pass
        return False

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Block until the service (one of its URLs) is ready; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"planner at {', '.join(self.urls)} not ready after {timeout} s")
            time.sleep(interval)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def submit(self, batch: dict | rollouts_pb2.RolloutBatch | bytes, *, content_type: str = "application/json",
               timeout: float | None = None, **topology) -> dict:
        """Submit a step's rollouts (idempotent by batch_id and content: retrying is always safe).

        Args:
            batch: the JSON document (dict), a RolloutBatch message (sent as protobuf), or body bytes
                of `content_type`.
            timeout: seconds for the call, retries included (default: the client's).
            topology: world_size, microbatch_tokens, memory_tokens, chunk_size, no_sharing,
                no_windows: plan at once for this topology.

        Returns:
            {"status": {...}, "duplicate": bool, "body_sha256": str}.

        Raises:
            IntegrityError: every attempt's answer named other bytes than those sent (a body altered
                in transit is refused by the service and sent again; an answer that names other
                bytes is asked for again, as a duplicate).
        """
        if isinstance(batch, dict):
            body = json.dumps(batch, separators=(",", ":")).encode()
        elif isinstance(batch, rollouts_pb2.RolloutBatch):
            body, content_type = batch.SerializeToString(deterministic=True), PROTOBUF
        else:
            body = bytes(batch)
        digest = hashlib.sha256(body).hexdigest()
        params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in topology.items() if v is not None}
        headers = {"Content-Type": content_type, BODY_SHA256_HEADER: digest}
        deadline = self._deadline(timeout)
        cap = self.retry.attempts or _BAD_SLICE_ATTEMPTS
        for attempt in range(1, cap + 1):
            try:
                resp = self._request("POST", "/v1/steps", content=body, params=params, headers=headers, deadline=deadline)
                answer = resp.json()
                got = answer.get("body_sha256") if isinstance(answer, dict) else None
                if got == digest:
                    return answer
                if isinstance(answer, dict) and "status" in answer and "body_sha256" not in answer:
                    # a planner of an earlier version: it reports no digest, so none can be compared
                    if not self._warned_no_digest:
                        log.warning("submit: the planner at %s reports no body_sha256 (an earlier version): "
                                    "submissions are not checked end to end", self.url)
                        self._warned_no_digest = True
                    return answer
                problem = f"{BODY_SHA256_HEADER}: sent the body's SHA-256 {digest}, the service answered {got!r}"
            except PlannerError as exc:
                if exc.code != "DATA_LOSS":
                    raise
                problem = exc.message  # the service received other bytes than those sent and stored nothing
            except ValueError:
                problem = "the answer is not JSON"
            log.warning("submit: %s (attempt %d/%d)", problem, attempt, cap)
            pause = self.retry.delay(attempt)
            if attempt == cap or time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
        raise IntegrityError(f"submit: {problem}; {attempt} attempt(s)")

    def plan(self, step_id: str, *, world_size: int, timeout: float | None = None, **topology) -> dict:
        """Plan a stored step for a topology; returns its status."""
        return self._request("POST", f"/v1/steps/{_seg(step_id)}/plan", json={"world_size": world_size, **topology},
                             deadline=self._deadline(timeout)).json()

    def status(self, step_id: str, *, timeout: float | None = None) -> dict:
        return self._request("GET", f"/v1/steps/{_seg(step_id)}", deadline=self._deadline(timeout)).json()

    def delete(self, step_id: str, *, timeout: float | None = None) -> dict:
        """Delete a step with its rollouts and plan; returns its status as it was."""
        return self._request("DELETE", f"/v1/steps/{_seg(step_id)}", deadline=self._deadline(timeout)).json()

    def list_steps(self, limit: int = 0, *, timeout: float | None = None) -> list[dict]:
        return self._request("GET", "/v1/steps", params={"limit": limit}, deadline=self._deadline(timeout)).json()["steps"]

    def fetch_plan_bytes(self, step_id: str, rank: int, *, timeout: float = 600.0, poll: float = 30.0,
                         world_size: int | None = None) -> bytes:
        """Sealed slice bytes of `rank`, long-polling until planned; verified before returning.

        Args:
            timeout: seconds for the whole fetch, long-polls and retries included.
            poll: longest single long-poll.
            world_size: the trainer's world size; a plan made for another one is refused.

        Raises:
            TimeoutError: not planned (or the service not reachable) within `timeout` seconds.
            PlannerError: planning failed, unknown rank, auth... (not retried).
            ChecksumError: every attempt returned a corrupted slice. WrongSliceError (a
                ChecksumError): every attempt returned another step's or rank's slice, or the
                plan is for another world size (at once: that will not change).
        """
        deadline = time.monotonic() + timeout
        bad = 0
        path = f"/v1/steps/{_seg(step_id)}/ranks/{int(rank)}/plan"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"plan of step {step_id!r} rank {rank} not ready after {timeout} s")
            wait = max(0.0, min(poll, remaining - _ANSWER_MARGIN_S))
            # an outage may run past the plan's deadline by up to retry_seconds
            ride = max(deadline, time.monotonic() + self.retry_seconds) if self.retry_seconds is not None else deadline
            try:
                resp = self._request("GET", path, params={"wait": wait}, deadline=ride, wait=wait)
            except PlannerError as exc:
                not_ready = exc.code == "DEADLINE_EXCEEDED" or (exc.code == "NOT_FOUND" and not exc.message.startswith("rank:"))
                if exc.status == 404 and not_ready:
                    continue
                if exc.status == 0:
                    raise TimeoutError(f"plan of step {step_id!r} rank {rank}: {exc.message}") from None
                if exc.status == 503 and time.monotonic() >= deadline:
                    raise TimeoutError(f"plan of step {step_id!r} rank {rank}: no plan within {timeout} s "
                                       f"(last: {exc})") from None
                if exc.status == 503:
                    continue  # storage fault or connection limit: keep polling until the deadline
                raise
            data = resp.content
            try:
                slice_ = open_sealed(data)
                header = resp.headers.get("X-Harts-Checksum")
                if header is not None and header != slice_.checksum:
                    raise ChecksumError(f"X-Harts-Checksum: expected {slice_.checksum}, got {header}")
                _check_slice(slice_, step_id, rank, world_size)
            except ChecksumError as exc:
                if isinstance(exc, WrongSliceError) and exc.final:
                    raise
                bad += 1
                cap = self.retry.attempts or _BAD_SLICE_ATTEMPTS
                log.warning("step %s rank %d: %s (attempt %d/%d)", step_id, rank, exc, bad, cap)
                pause = self.retry.delay(bad)
                if bad >= cap or time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                continue
            return data

    def fetch_plan(self, step_id: str, rank: int, *, timeout: float = 600.0, poll: float = 30.0,
                   world_size: int | None = None) -> plan_pb2.PlanSlice:
        """`fetch_plan_bytes`, parsed (already verified)."""
        return open_sealed(self.fetch_plan_bytes(step_id, rank, timeout=timeout, poll=poll, world_size=world_size))


def _seg(step_id: str) -> str:
    """A step id as one URL path segment (ids may hold any character but '/'; the service refuses
    '.' and '..', which a URL cannot carry as a segment)."""
    if step_id in ("", ".", ".."):
        raise ValueError(f"step_id: expected an id other than '', '.' and '..', got {step_id!r}")
    return quote(step_id, safe="")


def _check_slice(slice_: plan_pb2.PlanSlice, step_id: str, rank: int, world_size: int | None) -> None:
    got_step, got_rank = slice_.header.step_id, slice_.rank.rank
    if got_step != step_id or got_rank != rank:
        raise WrongSliceError(f"expected the plan slice of step {step_id!r} rank {rank}, got step {got_step!r} "
                              f"rank {got_rank}")
    planned = slice_.header.params.world_size
    if world_size is not None and planned != world_size:
        err = WrongSliceError(f"step {step_id!r} is planned for world_size {planned}, but this trainer runs {world_size} "
                              f"rank(s); launch torchrun with --nproc_per_node={planned} (x nodes) or plan the step "
                              "for this topology")
        err.final = True
        raise err


def _retry_after(resp: httpx.Response) -> float:
    """Seconds a 503's Retry-After asks for (0 when absent or not a number of seconds)."""
    try:
        seconds = float(resp.headers.get("retry-after", "0"))
    except ValueError:  # an HTTP date: not sent by the planner
        return 0.0
    return min(seconds, _MAX_RETRY_AFTER_S) if seconds > 0 and math.isfinite(seconds) else 0.0


def _error_of(resp: httpx.Response) -> PlannerError:
    try:
        err = resp.json()["error"]
        return PlannerError(resp.status_code, str(err.get("code", "")), str(err.get("message", "")), err.get("field"))
    except (ValueError, KeyError, TypeError):
        return PlannerError(resp.status_code, "UNKNOWN", resp.text[:200])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harts_client.client", description="Planner service client.")
    p.add_argument("--url", default=os.environ.get("HARTS_PLANNER_URL", "http://127.0.0.1:8000"),
                   help="planner base URL; several replicas' URLs separated by commas (failover)")
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
        print(f"harts_client.client: error: {exc}", file=sys.stderr)
        sys.exit(1)
