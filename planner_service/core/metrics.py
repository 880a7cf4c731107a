"""Prometheus metrics of the planner service.

Each `Metrics` owns its registry, so tests can run several service instances in one process.
Both transports record into the same instance; `/metrics` renders it in the text format.
See docs/design/service.md.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PLAN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_COMPRESSION_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


class Metrics:
    """Request counts and latency, ingest volume, plan time, compression, waiting steps, storage,
    caches, retention and HTTP connections."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "harts_requests_total", "Requests by transport, operation and status code.",
            ["transport", "operation", "code"], registry=r,
        )
        self.latency = Histogram(
            "harts_request_seconds", "Request latency by transport and operation (long-poll waits included).",
            ["transport", "operation"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ingest_bytes = Counter(
            "harts_ingest_bytes_total", "Request bytes of accepted rollout submissions.", ["format"], registry=r,
        )
        self.submissions = Counter(
            "harts_submissions_total", "Rollout submissions by outcome (new, duplicate).", ["outcome"], registry=r,
        )
        self.plan_seconds = Histogram(
            "harts_plan_seconds", "Wall time of planning one step.", buckets=_PLAN_BUCKETS, registry=r,
        )
        self.plans = Counter("harts_plans_total", "Planning attempts by outcome (planned, failed).", ["outcome"], registry=r)
        self.compression_ideal = Histogram(
            "harts_compression_ideal", "Expanded / unique tokens of planned steps.",
            buckets=_COMPRESSION_BUCKETS, registry=r,
        )
        self.compression_achieved = Histogram(
            "harts_compression_achieved", "Expanded / computed tokens of planned steps.",
            buckets=_COMPRESSION_BUCKETS, registry=r,
        )
        self.steps_waiting = Gauge(
            "harts_steps_waiting", "Steps submitted and not planned (nor failed) yet.", registry=r,
        )
        self.fetch_waiters = Gauge("harts_fetch_waiters", "Long-poll plan fetches currently waiting.", registry=r)
        self.storage_ok = Gauge(
            "harts_storage_ok", "1 while the database can be written, 0 during a storage fault.", registry=r,
        )
        self.storage_faults = Counter(
            "harts_storage_faults_total", "Changes from a writable database to a storage fault.", registry=r,
        )
        self.cache_bytes = Gauge("harts_cache_bytes", "Bytes held by an in-memory cache.", ["cache"], registry=r)
        self.steps_deleted = Counter(
            "harts_steps_deleted_total", "Deleted steps by cause (request, retention).", ["cause"], registry=r,
        )
        self.http_connections = Gauge("harts_http_connections", "Open HTTP connections.", registry=r)
        self.http_closed = Counter(
            "harts_http_connections_closed_total",
            "HTTP connections the server closed by reason (header_timeout, body_timeout, evicted, refused).",
            ["reason"], registry=r,
        )

    @contextmanager
    def request(self, transport: str, operation: str):
        """Time one request; the body sets `box["code"]` (defaults to "200" / "OK" on success)."""
        box = {"code": "OK" if transport == "grpc" else "200"}
        t0 = time.perf_counter()
        try:
            yield box
        finally:
            self.latency.labels(transport, operation).observe(time.perf_counter() - t0)
            self.requests.labels(transport, operation, str(box["code"])).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
