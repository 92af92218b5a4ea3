"""``settled mcp`` (the MCP server for AI agents) and ``settled proposals`` (staff deciding
what agents proposed: list, approve, decline)."""

from __future__ import annotations

import json
from typing import Any

import click

from settled.cli.common import TEXT, Text

PORT = click.IntRange(1, 65535)
HANDLE = Text(max_length=64)


@click.command("mcp")
@click.option(
    "--transport",
    type=click.Choice(["stdio", "http"]),
    default="stdio",
    show_default=True,
    help="stdio: one tenant (SETTLED_AGENT_TENANT); http: a tenant's API key as bearer token",
)
@click.option("--host", default="127.0.0.1", show_default=True, type=TEXT)
@click.option("--port", default=8800, show_default=True, type=PORT)
def mcp(transport: str, host: str, port: int) -> None:
    """Serve the tools for AI agents over the Model Context Protocol."""
    from outbox import relay
    from outbox.errors import InvalidInput
    from outbox.ids import validate_tenant
    from outbox.settings import Settings
    from settled.celery_app import create_app, hint_publisher
    from settled.mcp_http import serve
    from settled.mcp_server import build_server
    from settled.preflight import announce, preflight
    from settled.runtime import build_runtime

    settings = Settings()
    if transport == "stdio" and settings.agent_tenant is None:
        raise InvalidInput(
            "a stdio server speaks for one tenant: set SETTLED_AGENT_TENANT",
            code="invalid_setting",
        )
    if settings.agent_tenant is not None:
        validate_tenant(settings.agent_tenant)
    # It approves (and so fingerprints) and publishes hints: the worker's checks, broker too.
    announce(preflight(settings, broker=True), f"mcp --transport {transport}")
    rt = build_runtime(settings)
    # Commits publish hints for the operations they created: an approved proposal's
    # operation is sent at once, not at the sweeper's next pass.
    relay.install(rt.sessions, hint_publisher(create_app(settings)), observer=rt.observer)
    try:
        if transport == "stdio":
            build_server(rt.agent_desk(tenant=settings.agent_tenant)).run("stdio")
            return
        url = f"http://{host}:{port}"
        click.echo(f"MCP server on {url}/mcp", err=True)
        desk = rt.agent_desk(tenant=None)
        serve(build_server(desk, http_url=url), host=host, port=port, log_level=_level())
    finally:
        rt.close()


def _level() -> str:
    """uvicorn's level: the root logger's, as ``outbox.logs.configure`` set it."""
    import logging

    return logging.getLevelName(logging.getLogger().level)


@click.group()
def proposals() -> None:
    """What AI agents proposed and nobody has decided yet (staff approve or decline)."""


def _in_transaction(action: Any) -> Any:
    """Run ``action(proposals_service, session)`` in one transaction on the configured
    database, with the MCP server's rules (the configured contracts, the repeat window)."""
    from outbox.settings import Settings
    from settled.preflight import preflight
    from settled.runtime import build_runtime

    settings = Settings()
    preflight(settings, broker=False)  # an approval fingerprints: the worker's keys, or none
    # The MCP server's service, built by the same root. No hint from a one-shot command: a
    # broker that is down would hold it in the publish's retries, and the sweeper picks the
    # approved operation up within SETTLED_SWEEP_SECONDS.
    rt = build_runtime(settings)
    try:
        with rt.sessions.begin() as session:
            return action(rt.proposals, session)
    finally:
        rt.close()


#: What a line of ``settled proposals`` shows of a proposal, in this order.
FIELDS = (
    "handle", "tenant", "kind", "params", "reason", "status", "decided_by", "op_id", "created_at",
)  # fmt: skip


def _row(p: Any) -> dict[str, Any]:
    from support.approvals import proposal_row

    shown = proposal_row(p)
    return {name: shown[name] for name in FIELDS}


@proposals.command("list")
@click.option("--tenant", type=TEXT, default=None, help="one tenant's only")
def proposals_list(tenant: str | None) -> None:
    """The proposals waiting for a decision, oldest first, as JSON lines."""
    rows = _in_transaction(lambda svc, s: [_row(p) for p in svc.waiting(s, tenant)])
    for row in rows:
        click.echo(json.dumps(row, ensure_ascii=False))
    click.echo(f"{len(rows)} waiting", err=True)


@proposals.command("approve")
@click.option("--tenant", required=True, type=TEXT)
@click.option("--staff", envvar="SETTLED_STAFF_ID", required=True, type=TEXT, help="your id")
@click.argument("handle", type=HANDLE)
def proposals_approve(tenant: str, staff: str, handle: str) -> None:
    """Approve HANDLE: its exact parameters become an operation under a new op_id."""
    row = _in_transaction(lambda svc, s: _row(svc.approve(s, tenant, handle, by=f"staff:{staff}")))
    click.echo(json.dumps(row, ensure_ascii=False))


@proposals.command("decline")
@click.option("--tenant", required=True, type=TEXT)
@click.option("--staff", envvar="SETTLED_STAFF_ID", required=True, type=TEXT, help="your id")
@click.argument("handle", type=HANDLE)
def proposals_decline(tenant: str, staff: str, handle: str) -> None:
    """Decline HANDLE: nothing is sent."""
    row = _in_transaction(lambda svc, s: _row(svc.decline(s, tenant, handle, by=f"staff:{staff}")))
    click.echo(json.dumps(row, ensure_ascii=False))
