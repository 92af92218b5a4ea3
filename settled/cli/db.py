"""``settled db``: the operations database (upgrade, current). Each names the database it
worked on (password masked) and the schema version it found."""

from __future__ import annotations

import click

from settled.cli.common import TEXT


@click.group()
def db() -> None:
    """The operations database."""


def _database(url: str | None) -> tuple[str, str]:
    """The database URL to work on and how the line names it: ``--url``, else the settings
    (read whole: an unknown SETTLED_* variable, a misspelt SETTLED_DATABASE_URL among them,
    is refused before anything is created); the default is said to be one."""
    from outbox.settings import Settings, masked

    settings = Settings()
    if url is None:
        url = settings.database_url
        if "database_url" not in settings.model_fields_set:
            return url, f"{masked(url)} (the default: SETTLED_DATABASE_URL is not set)"
    return url, masked(url)


def _at(revisions: set[str]) -> str:
    return ", ".join(sorted(revisions)) or "nothing"


@db.command("upgrade")
@click.option(
    "--url", type=TEXT, envvar="SETTLED_DATABASE_URL", help="database URL (default: settings)"
)
def db_upgrade(url: str | None) -> None:
    """Apply every migration; say what it did ("migrated ... from 0003 to 0008", "already at
    0008")."""
    from outbox.db import sqlite_file
    from outbox.db import upgrade as apply

    url, named = _database(url)
    path = sqlite_file(url)
    created = path is not None and not path.exists()
    before, after = apply(url)
    if before == after:
        click.echo(f"{named} already at {_at(after)}")
    elif created:
        click.echo(f"created {named} and migrated it from nothing to {_at(after)}")
    else:
        click.echo(f"migrated {named} from {_at(before)} to {_at(after)}")


@db.command("current")
@click.option(
    "--url", type=TEXT, envvar="SETTLED_DATABASE_URL", help="database URL (default: settings)"
)
def db_current(url: str | None) -> None:
    """The schema version the database is at, and the newest this release has. Writes
    nothing (an SQLite file that does not exist is at nothing, and is not created)."""
    from outbox.db import schema_heads, schema_revisions

    url, named = _database(url)
    current, newest = schema_revisions(url), schema_heads(url)
    if current == newest:
        click.echo(f"{named} at {_at(current)} (the newest)")
    else:
        click.echo(f"{named} at {_at(current)}; newest {_at(newest)}: run `settled db upgrade`")
