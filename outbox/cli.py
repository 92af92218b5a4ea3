"""The ``settled`` command line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

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
    from outbox import logs
    from outbox.settings import Settings
    from workers.celery_app import create_app, worker_argv

    settings = Settings()
    logs.configure(loglevel)
    if beat:
        _beat_folder(settings)
    if settings.metrics_port is not None:
        _serve_metrics(settings)
    app = create_app(settings)
    app.worker_main(
        worker_argv(
            beat=beat, pool=pool, concurrency=concurrency, loglevel=loglevel, hostname=hostname
        )
    )


def _serve_metrics(settings: Any) -> None:
    """Serve Prometheus metrics from this (the worker's main) process, read from the database."""
    import os

    from prometheus_client import start_http_server
    from sqlalchemy.orm import sessionmaker

    from outbox.db import make_engine
    from workers.metrics import registry

    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    # Pool children must not share this engine's connections.
    os.register_at_fork(after_in_child=lambda: engine.dispose(close=False))
    start_http_server(settings.metrics_port, registry=registry(sessionmaker(engine)))


@main.command()
@click.option("--loglevel", default="INFO", show_default=True)
def beat(loglevel: str) -> None:
    """Run celery beat: the sweeper and the reconciler on their schedules (run one)."""
    from outbox import logs
    from outbox.settings import Settings
    from workers.celery_app import create_app

    logs.configure(loglevel)
    settings = Settings()
    _beat_folder(settings)
    create_app(settings).start(["beat", f"--loglevel={loglevel}"])


def _beat_folder(settings: Any) -> None:
    """Create the folder of beat's state file: beat cannot start without it (and then nothing
    sweeps or reconciles)."""
    from pathlib import Path

    Path(settings.beat_schedule_file).parent.mkdir(parents=True, exist_ok=True)


def _runtime() -> Any:
    from outbox.settings import Settings
    from workers.runtime import build_runtime

    return build_runtime(Settings())


def _emit(data: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    if isinstance(data, list):
        for row in data:
            click.echo(
                f"#{row['id']:<5} {row['tenant']:<12} {row['op_id']:<28} {row['kind']:<12} "
                f"{row['reason']:<36} v{row['version']} since {row['created_at']}"
            )
        click.echo(f"{len(data)} item(s)")
        return
    click.echo(json.dumps(data, indent=2, default=str))


@contextmanager
def _errors() -> Iterator[None]:
    from outbox.errors import SettledError

    try:
        yield
    except SettledError as exc:
        raise click.ClickException(f"[{exc.code}] {exc.message}") from None


@main.command()
@click.option("--once", is_flag=True, help="run one pass, print its report and exit")
def reconcile(once: bool) -> None:
    """Run reconcile passes now (beat runs them on a schedule); ``--once`` for operators."""
    import time

    rt = _runtime()
    try:
        while True:
            click.echo(json.dumps(rt.reconciler.run_once().as_dict()))
            if once:
                return
            time.sleep(rt.settings.reconcile_seconds)
    finally:
        rt.close()


staff_options = [
    click.option("--staff", envvar="SETTLED_STAFF_ID", required=True, help="your staff id"),
    click.option(
        "--role",
        envvar="SETTLED_STAFF_ROLE",
        required=True,
        type=click.Choice(["viewer", "support", "supervisor"]),
    ),
    click.option("--json", "as_json", is_flag=True, help="machine-readable output"),
]


def with_staff(f: Any) -> Any:
    for option in reversed(staff_options):
        f = option(f)
    return f


@main.group()
def review() -> None:
    """The manual review queue (support staff)."""


def _as_staff(staff: str, role: str, action: Any) -> Any:
    """Run ``action(review_queue, staff)`` with the staff's identity checked first."""
    from reconciler.review import Staff

    with _errors():
        who = Staff.parse(staff, role)
        rt = _runtime()
        try:
            return action(rt.review, who)
        finally:
            rt.close()


@review.command("list")
@click.option("--tenant", default=None)
@click.option("--reason", default=None)
@click.option("--older-than", type=float, default=None, help="seconds")
@click.option("--all", "include_resolved", is_flag=True, help="include resolved items")
@with_staff
def review_list(
    tenant: str | None,
    reason: str | None,
    older_than: float | None,
    include_resolved: bool,
    staff: str,
    role: str,
    as_json: bool,
) -> None:
    """Open review items, oldest first."""
    age = timedelta(seconds=older_than) if older_than is not None else None
    items = _as_staff(
        staff,
        role,
        lambda q, who: q.list(
            who, tenant=tenant, reason=reason, older_than=age, include_resolved=include_resolved
        ),
    )
    _emit(items, as_json)


@review.command("show")
@click.argument("item", type=int)
@with_staff
def review_show(item: int, staff: str, role: str, as_json: bool) -> None:
    """One item: the operation, its attempts, lookups and events."""
    _emit(_as_staff(staff, role, lambda q, who: q.show(who, item)), True)


@review.command("requery")
@click.argument("item", type=int)
@with_staff
def review_requery(item: int, staff: str, role: str, as_json: bool) -> None:
    """Ask the downstream again now."""
    _emit(_as_staff(staff, role, lambda q, who: q.requery(who, item)), True)


@review.command("resolve")
@click.argument("item", type=int)
@click.option("--as", "outcome", required=True, type=click.Choice(["succeeded", "rejected"]))
@click.option("--version", required=True, type=int, help="the item version you read (show)")
@click.option("--reference", default=None, help="downstream reference (for succeeded)")
@click.option("--justification", default=None, help="why (required for rejected)")
@with_staff
def review_resolve(
    item: int,
    outcome: str,
    version: int,
    reference: str | None,
    justification: str | None,
    staff: str,
    role: str,
    as_json: bool,
) -> None:
    """Settle an item's operation as succeeded or rejected, with evidence."""
    result = _as_staff(
        staff,
        role,
        lambda q, who: q.resolve(
            who,
            item,
            outcome=outcome,
            version=version,
            reference=reference,
            justification=justification,
        ),
    )
    _emit(result, True)


@main.command()
@click.option("--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True)
@click.option("--keep", default=None, help="keep the demo's files in this folder")
def demo(lang: str, keep: str | None) -> None:
    """Play the cases a payment team meets, on the embedded default (nothing to install)."""
    from workers.demo import run_demo

    raise SystemExit(run_demo(lang=lang, keep=keep, echo=click.echo))


@main.command("run")
@click.option("--web-port", default=8000, show_default=True, type=int)
@click.option("--concurrency", default=2, show_default=True, type=int)
def run_stack(web_port: int, concurrency: int) -> None:
    """Worker, beat and web for a single machine, against the configured PostgreSQL and Redis."""
    from workers.supervise import settled_command, supervise

    raise SystemExit(
        supervise(
            [
                settled_command("worker", "--pool=prefork", f"--concurrency={concurrency}"),
                settled_command("beat"),
                settled_command("web", "--host=0.0.0.0", f"--port={web_port}"),
            ]
        )
    )


if __name__ == "__main__":
    main()
