"""The bearer token: one check for both transports, and the HTTP gate that applies it.

Every request under /v1 and /metrics, and every harts.v1.Planner RPC, carries `Authorization:
Bearer <token>` (gRPC: metadata `authorization`) when the service has a token; health checks,
/docs and /openapi.json never need one. `TokenGate` answers 401 before routing, so an
unauthenticated request is refused before any of its body is read (docs/design/service.md).
"""
from __future__ import annotations

import hmac

from planner_service.transport.http_errors import error_response

__all__ = ["bearer_ok", "needs_token", "TokenGate"]


def bearer_ok(authorization: bytes, token: bytes) -> bool:
    """Whether an `Authorization` value is `Bearer <token>` (compared in constant time)."""
    scheme, _, cred = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(cred.strip(), token)


def needs_token(path: str) -> bool:
    """Whether an HTTP path needs the token (everything under /v1, and /metrics)."""
    return path.startswith("/v1/") or path == "/v1" or path == "/metrics"


class TokenGate:
    """ASGI middleware: 401 for a request under /v1 or /metrics without the configured bearer
    token, before routing reads any of its body."""

    def __init__(self, app, token: str | None):
        self.app, self.token = app, token.encode() if token is not None else None

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http" or not needs_token(scope["path"]):
            return await self.app(scope, receive, send)
        got = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                got = value
        if bearer_ok(got, self.token):
            return await self.app(scope, receive, send)
        resp = error_response(401, "UNAUTHENTICATED",
                              "Authorization: expected 'Bearer <token>' with the service's token",
                              headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)
