"""``settled db``: the operations database."""

from __future__ import annotations

import click

from settled.cli.common import TEXT


@click.group()
def db() -> None:
    """The operations database."""


@db.command("upgrade")
@click.option(
    "--url", type=TEXT, envvar="SETTLED_DATABASE_URL", help="database URL (default: settings)"
)
def db_upgrade(url: str | None) -> None:
    """Apply every migration."""
    from outbox.db import upgrade
    from outbox.settings import Settings

    upgrade(url or Settings().database_url)
    click.echo("database is up to date")
