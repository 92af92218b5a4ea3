"""The ``settled`` command line."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """Settled: safe side-effecting operations."""


@main.group()
def db() -> None:
    """The operations database."""


@db.command("upgrade")
@click.option("--url", envvar="SETTLED_DATABASE_URL", help="database URL (default: settings)")
def db_upgrade(url: str | None) -> None:
    """Apply every migration."""
    from outbox.db import upgrade
    from outbox.settings import Settings

    upgrade(url or Settings().database_url)
    click.echo("database is up to date")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8700, show_default=True, type=int)
@click.option(
    "--ledger", default="simulator.sqlite3", show_default=True, help="ledger URL or SQLite path"
)
@click.option("--test-mode", is_flag=True, help="enable the control API (fault rules, ledger)")
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    metavar="NAME=API_KEY",
    envvar="SETTLED_SIMULATOR_TENANTS",
    help="register a tenant and its API key (repeatable; env: space-separated)",
)
def simulator(host: str, port: int, ledger: str, test_mode: bool, tenants: tuple[str, ...]) -> None:
    """Run the payment service simulator."""
    import logging

    from workers.simulator import run

    keys: dict[str, str] = {}
    for spec in tenants:
        name, sep, key = spec.partition("=")
        if not sep or not name or not key:
            raise click.BadParameter("expected NAME=API_KEY", param_hint="--tenant")
        keys[name] = key
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    click.echo(f"simulator on http://{host}:{port} (test mode: {'on' if test_mode else 'off'})")
    run(host=host, port=port, ledger=ledger, test_mode=test_mode, tenants=keys)


@main.command()
@click.option("--beat/--no-beat", default=False, help="also run beat (sweeper, reconciler)")
@click.option("--pool", default="prefork", show_default=True, help="prefork, solo or threads")
@click.option("--concurrency", default=2, show_default=True, type=int)
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--hostname", default=None, help="Celery node name")
def worker(beat: bool, pool: str, concurrency: int, loglevel: str, hostname: str | None) -> None:
    """Run a Celery worker on the submit queue (claim, send, record)."""
    from outbox.settings import Settings
    from workers.celery_app import create_app, worker_argv

    app = create_app(Settings())
    app.worker_main(
        worker_argv(
            beat=beat, pool=pool, concurrency=concurrency, loglevel=loglevel, hostname=hostname
        )
    )


@main.command()
@click.option("--loglevel", default="INFO", show_default=True)
def beat(loglevel: str) -> None:
    """Run celery beat: the sweeper and the reconciler on their schedules (run one)."""
    from outbox.settings import Settings
    from workers.celery_app import create_app

    create_app(Settings()).start(["beat", f"--loglevel={loglevel}"])


if __name__ == "__main__":
    main()
