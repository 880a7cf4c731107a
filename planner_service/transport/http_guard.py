"""Connection guard of the HTTP server: header, body and idle timeouts and a bound on connections.

    guard = ConnectionGuard(ConnectionConfig(max_connections=1024), metrics)
    uvicorn.Config(app, http=guard.protocol(), ...)      # GuardedH11Protocol: uvicorn's h11 plus timers

uvicorn's h11 protocol keeps a connection as long as the client does; this bounds what one
connection can hold, evicts in a fixed order over the bound (never a connection that has just
opened) and counts every closing in `harts_http_connections_closed_total{reason}`
(docs/design/service.md, "Connections and request limits").
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from planner_service.transport.status_codes import RETRY_AFTER_SECONDS

log = logging.getLogger(__name__)

__all__ = ["ConnectionConfig", "ConnectionGuard", "GuardedH11Protocol"]

_LOG_EVERY_S = 60.0
_OVERFLOW = 128
"""Connections admitted over the bound while the ones just opened may still turn out half-sent
(one accept burst: the server's file-descriptor budget keeps room for it)."""
_STALLED_S = 1.0
"""An upload without data, or a connection without a byte, for this long may be closed to admit
a new connection."""


@dataclass(slots=True, kw_only=True)
class ConnectionConfig:
    """What one HTTP connection may hold, and how many may be open."""

    max_connections: int = 1000
    """Open HTTP connections at most (the server also keeps this below its file-descriptor limit)."""
    header_timeout: float = 10.0
    """Seconds to send the request line and headers."""
    body_timeout: float = 30.0
    """Seconds allowed between two pieces of a request body."""
    idle_timeout: float = 30.0
    """Seconds a keep-alive connection may wait for its next request."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections: expected >= 1, got {self.max_connections}")
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value}")


def _raw_response(status: int, phrase: str, code: str, message: str, *, retry_after: bool = False) -> bytes:
    """A complete `Connection: close` response with the service's JSON error body."""
    body = json.dumps({"error": {"code": code, "message": message, "field": None}}).encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n" + (f"retry-after: {RETRY_AFTER_SECONDS}\r\n" if retry_after else "") + "\r\n")
    return head.encode("ascii") + body


class ConnectionGuard:
    """State shared by the connections of one server: who waits, counts, the rate-limited log.

    Args:
        limits: the bounds.
        metrics: `planner_service.metrics.Metrics` to count into (None: not counted).
    """

    def __init__(self, limits: ConnectionConfig, metrics=None):
        self.limits = limits
        self.metrics = metrics
        self.open = 0
        # evictable connections by kind, least recently active first (eviction order)
        self._evictable: dict[str, OrderedDict[GuardedH11Protocol, float]] = {
            kind: OrderedDict() for kind in ("half_sent", "idle", "fresh")}
        self._uploading: OrderedDict[GuardedH11Protocol, float] = OrderedDict()
        self._evicting = 0  # evicted, not closed yet: no longer counted against the bound
        self._pending: Counter[str] = Counter()
        self._last_log = -math.inf

    def protocol(self):
        """The protocol factory for `uvicorn.Config(http=...)`."""
        return functools.partial(GuardedH11Protocol, guard=self)

    def opened(self, proto: GuardedH11Protocol) -> bool:
        """Count a new connection; False when it must be refused (all others busy)."""
        self.open += 1
        self._gauge()
        if self.open - self._evicting <= self.limits.max_connections or self._evict_one(proto):
            return True
        # no victim now, but connections that opened or sent body data just now may turn out to
        # be half-sent or stalled: admit this one for the moment (within one accept burst over the bound)
        young = bool(self._evictable["fresh"]) or bool(self._uploading)
        return young and self.open - self._evicting <= self.limits.max_connections + _OVERFLOW

    def rebalance(self, proto: GuardedH11Protocol) -> None:
        """Close victims while more than max_connections are open (`proto` just changed phase)."""
        while self.open - self._evicting > self.limits.max_connections and self._evict_one(proto):
            pass

    def _evict_one(self, proto: GuardedH11Protocol) -> bool:
        """Close one evictable connection other than `proto`, in this order: the longest half-sent headers,
        the longest idle, the oldest silent one (>= _STALLED_S), the longest-stalled upload (>= _STALLED_S)."""
        now = time.monotonic()
        pools = [(kind, pool) for kind, pool in self._evictable.items()] + [("uploading", self._uploading)]
        for kind, pool in pools:
            while True:
                victim = next((v for v in pool if v is not proto), None)  # the oldest but `proto`
                if victim is None or (kind in ("fresh", "uploading") and now - pool[victim] < _STALLED_S):
                    break
                del pool[victim]
                if victim.evict():  # False: it is closing already
                    self._evicting += 1
                    self.note("evicted")
                    return True
        return False

    def closed(self, proto: GuardedH11Protocol) -> None:
        self.open -= 1
        if proto.evicted:
            self._evicting -= 1
        for waiting in self._evictable.values():
            waiting.pop(proto, None)
        self._uploading.pop(proto, None)
        self._gauge()

    def waiting(self, proto: GuardedH11Protocol, kind: str | None) -> None:
        """Mark a connection as evictable, most recently active last: kind "half_sent" (part of
        its headers), "idle" (keep-alive between requests), "fresh" (connected, nothing sent),
        "uploading" (receiving a body), or None (busy: not evictable)."""
        for waiting in self._evictable.values():
            waiting.pop(proto, None)
        self._uploading.pop(proto, None)
        if kind in self._evictable:
            self._evictable[kind][proto] = time.monotonic()
        elif kind == "uploading":
            self._uploading[proto] = time.monotonic()

    def note(self, reason: str) -> None:
        """Count one connection the guard closed; log at once, then at most once a minute."""
        if self.metrics is not None:
            self.metrics.http_closed.labels(reason).inc()
        self._pending[reason] += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            lim = self.limits
            log.warning(
                "HTTP connections closed by the guard%s: %s (open now %d of at most %d; header timeout %gs, "
                "body timeout %gs, idle timeout %gs; harts_http_connections_closed_total counts them all)",
                "" if self._last_log == -math.inf else f" in the last {now - self._last_log:.0f} s",
                ", ".join(f"{k} {v}" for k, v in sorted(self._pending.items())), self.open, lim.max_connections,
                lim.header_timeout, lim.body_timeout, lim.idle_timeout,
            )
            self._pending.clear()
            self._last_log = now

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.http_connections.set(self.open)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard's timers and connection bound (docs/design/service.md)."""

    def __init__(self, config, server_state, app_state, _loop=None, *, guard: ConnectionGuard):
        super().__init__(config, server_state, app_state, _loop)
        self._guard = guard
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        self._partial = False  # bytes of a request whose headers are not complete yet
        self.evicted = False

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self._guard.opened(self):
            self._guard.note("refused")
            self._phase = "closed"
            lim = self._guard.limits
            self._close_with(_raw_response(
                503, "Service Unavailable", "UNAVAILABLE",
                f"the server holds {lim.max_connections} connections, all busy with requests; retry shortly",
                retry_after=True))
            return
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._guard.closed(self)
        self._phase = "closed"
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "closed":
            return
        if self._phase in ("header", "idle", ""):
            self._partial = True
        super().data_received(data)
        self._update(data_arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    # ---- the guard

    def _update(self, data_arrived: bool = False) -> None:
        if self._phase == "closed" or self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle
        active = cycle is not None and not cycle.response_complete
        their = self.conn.their_state
        if their is h11.SEND_BODY:
            phase = "body"
        elif active or their is not h11.IDLE:
            phase = "busy"
        else:
            phase = "header" if (self._partial or self._phase in ("", "header")) else "idle"
        if phase in ("body", "busy"):
            self._partial = False
        if phase == self._phase and not (phase == "body" and data_arrived):
            if phase == "header" and data_arrived:
                self._guard.waiting(self, "half_sent")  # the header timer keeps running
                self._guard.rebalance(self)
            return
        self._phase = phase
        self._cancel_timer()
        lim = self._guard.limits
        if phase == "header":
            self._timer = self.loop.call_later(lim.header_timeout, self._expired)
        elif phase == "body":
            self._timer = self.loop.call_later(lim.body_timeout, self._expired)
        if phase == "header":
            kind = "half_sent" if self._partial else "fresh"
        else:
            kind = {"idle": "idle", "body": "uploading"}.get(phase)
        self._guard.waiting(self, kind)
        self._guard.rebalance(self)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        lim = self._guard.limits
        if self._phase == "header":
            self._guard.note("header_timeout")
            if self._partial:
                self._close_with(_raw_response(408, "Request Timeout", "DEADLINE_EXCEEDED",
                                               f"request headers not complete within {lim.header_timeout:g} s"))
            else:
                self.transport.close()
        elif self._phase == "body":
            self._guard.note("body_timeout")
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                # the application still waits for the body: it gets a disconnect, the client a 408
                cycle.disconnected = True
                cycle.message_event.set()
                self._close_with(_raw_response(408, "Request Timeout", "DEADLINE_EXCEEDED",
                                               f"no request body data for {lim.body_timeout:g} s"))
            else:
                self.transport.close()

    def evict(self) -> bool:
        """Close this waiting connection to admit a new one; False if it is already closing."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.evicted = True
        self._cancel_timer()
        why = f"closed to admit another connection (at most {self._guard.limits.max_connections} are open)"
        cycle = self.cycle
        if self._phase == "header" and self._partial:
            self._close_with(_raw_response(408, "Request Timeout", "DEADLINE_EXCEEDED",
                                           f"request headers not complete; {why}"))
        elif self._phase == "body" and cycle is not None and not cycle.response_started:
            cycle.disconnected = True
            cycle.message_event.set()
            self._close_with(_raw_response(408, "Request Timeout", "DEADLINE_EXCEEDED",
                                           f"request body stalled; {why}"))
        else:
            self.transport.close()
        return True

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not an HTTP/1.1 request, with the service's JSON
        error body: 431 for a request line and headers over h11's limit (a 1 MB step id)."""
        pending, _ = self.conn.trailing_data
        limit = self.conn._max_incomplete_event_size
        if len(pending) > limit:
            response = _raw_response(431, "Request Header Fields Too Large", "INVALID_ARGUMENT",
                                     f"request line and headers: expected at most {limit} bytes, got more (a step "
                                     "id is at most 512 characters)")
        else:
            response = _raw_response(400, "Bad Request", "INVALID_ARGUMENT", "expected an HTTP/1.1 request, got "
                                     "bytes that do not parse as one")
        self._phase = "closed"
        self._close_with(response)

    def _close_with(self, response: bytes) -> None:
        self._cancel_timer()
        self.transport.write(response)
        self.transport.close()
