"""``settled apikey``: the status API's keys (one tenant per key; stored hashed)."""

from __future__ import annotations

from typing import Any

import click

from settled.cli.common import TEXT, Text, in_transaction


@click.group()
def apikey() -> None:
    """API keys of the status API (one tenant per key; stored hashed)."""


@apikey.command("create")
@click.option("--tenant", required=True, type=TEXT)
def apikey_create(tenant: str) -> None:
    """Create a key for TENANT and print it once (it cannot be shown again); its id goes to
    stderr."""
    from outbox.apikeys import create_api_key

    def create(session: Any) -> tuple[str, str]:
        row, key = create_api_key(session, tenant=tenant)
        return row.key_id, key

    key_id, key = in_transaction(create)
    click.echo(f"key id: {key_id}", err=True)
    click.echo(key)


@apikey.command("revoke")
@click.argument("key_id", type=Text(max_length=64))
def apikey_revoke(key_id: str) -> None:
    """Revoke the key whose id is KEY_ID."""
    from outbox.apikeys import revoke_api_key

    in_transaction(lambda session: revoke_api_key(session, key_id))
    click.echo("revoked")
