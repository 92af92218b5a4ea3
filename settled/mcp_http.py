"""``settled mcp --transport http``: the MCP server's streamable-HTTP app under uvicorn, with
every line through ``outbox.logs``.

The SDK's own ``run("streamable-http")`` hands uvicorn its default logging: a handler of its
own (plain text, not JSON) and an access log that names the client's address and port. Here
uvicorn logs through the root handler (``log_config=None``) and its access log is off; instead
``AccessLog`` writes one line per request in the status API's shape (``settled.access``:
method, path without the query, status, duration, and the tenant whose key was accepted),
never the client's address.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mcp.server.mcpserver import MCPServer

#: the status API's access log (``settled.web``): one shape for both servers
access_log = logging.getLogger("settled.access")

Scope = dict[str, Any]
Receive = Any
Send = Any


class AccessLog:
    """ASGI middleware: one ``settled.access`` line per HTTP request, when it ends."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            access_log.info(
                "request",
                extra={
                    "method": scope.get("method"),
                    "path": str(scope.get("path", ""))[:200],
                    "status": status,
                    "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    "tenant": _tenant(scope),
                },
            )


def _tenant(scope: Scope) -> str | None:
    """The tenant of the API key the SDK's bearer authentication accepted (its client id)."""
    token = getattr(scope.get("user"), "access_token", None)
    tenant = getattr(token, "client_id", None)
    return tenant if isinstance(tenant, str) else None


#: what a 401 tells the client: no OAuth flow, an API key as the bearer token
BEARER_HINT = (
    "Send a Settled API key of your tenant as 'Authorization: Bearer <key>' (an operator "
    "makes one with 'settled apikey create --tenant <tenant>'). There is no OAuth flow."
)


class BearerHint:
    """ASGI middleware: a 401 says how to authenticate (``BEARER_HINT``), in its
    ``WWW-Authenticate`` header and its JSON body, instead of the SDK's bare "Authentication
    required"; every other answer passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 401:
                refused = True
                body = json.dumps(
                    {"error": "invalid_token", "error_description": BEARER_HINT}
                ).encode()
                www = (
                    'Bearer realm="settled", error="invalid_token", '
                    f'error_description="{BEARER_HINT}"'
                )
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", www.encode()),
                ]
                await send({**message, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if refused:  # the SDK's own body of the 401: already answered
                return
            await send(message)

        await self.app(scope, receive, sending)


def http_app(server: MCPServer, *, host: str) -> AccessLog:
    """The server's streamable-HTTP app (at ``/mcp``) inside the bearer hint and the access
    log."""
    return AccessLog(BearerHint(server.streamable_http_app(host=host)))


def serve(server: MCPServer, *, host: str, port: int, log_level: str) -> None:
    """Run the streamable-HTTP transport with uvicorn (blocking)."""
    import uvicorn

    uvicorn.run(
        http_app(server, host=host),
        host=host,
        port=port,
        log_config=None,
        log_level=log_level.lower(),
        access_log=False,
    )
