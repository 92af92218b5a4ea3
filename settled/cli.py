"""The ``settled`` command line.

Bad input, bad configuration and refused actions end with one line on stderr (``Error: ...``)
and a non-zero exit status, never a traceback: values are checked at the edge (bounded
integers, text that is valid UTF-8), and what still goes wrong below is translated by
``_OneLineErrors`` without quoting SQL parameters or secrets.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import click

#: Largest value of a BIGINT column (PostgreSQL ids) and of an INTEGER one (item versions).
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1


class _OneLineErrors(click.Group):
    """The root group: every error below it becomes one ``Error: ...`` line and an exit status
    (2 for usage errors, 1 for the rest), instead of click's usage banner or a traceback."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except Exception as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            raise _one_line(exc) from None


class _Failure(click.ClickException):
    """One ``Error: ...`` line; exit status 1."""


class _UsageFailure(click.ClickException):
    """One ``Error: ...`` line for a usage error; exit status 2, as click's own."""

    exit_code = 2


def _one_line(exc: Exception) -> Exception:
    """The one-line error for ``exc``; exceptions that are not errors of input, configuration
    or the environment (bugs) are returned unchanged, to keep their traceback."""
    import pydantic
    import pydantic_settings
    import sqlalchemy.exc

    from outbox.errors import SettledError

    if isinstance(exc, click.exceptions.NoArgsIsHelpError | click.exceptions.Exit):
        return exc  # the help text, or an exit status: not errors
    if isinstance(exc, click.UsageError):
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        return _UsageFailure(f"{where}{exc.format_message()}")
    if isinstance(exc, click.ClickException):
        return exc
    if isinstance(exc, SettledError):
        return _Failure(f"[{exc.code}] {exc.message}")
    if isinstance(exc, pydantic.ValidationError):
        from outbox.settings import settings_error

        return _Failure(settings_error(exc))  # never the input values: they may be secrets
    if isinstance(exc, pydantic_settings.SettingsError):
        return _Failure(f"invalid configuration: {exc}")  # names the field, not the value
    if isinstance(exc, sqlalchemy.exc.ArgumentError):
        return _Failure("invalid database URL")  # the URL itself may carry a password
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and _no_tables(exc):
        return _Failure("the database has no Settled tables: run `settled db upgrade`")
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        # The driver's own first line, never SQLAlchemy's text (it quotes the parameters).
        first = (str(exc.orig).strip().splitlines() or [""])[0][:200]
        return _Failure(f"database error ({type(exc.orig).__name__}): {first}")
    if isinstance(exc, UnicodeError):
        return _Failure("text input must be valid UTF-8")
    return exc


def _no_tables(exc: Any) -> bool:
    """A database error that says a Settled table does not exist (never migrated)."""
    name = type(exc.orig).__name__
    return name == "UndefinedTable" or (
        name == "OperationalError" and "no such table" in str(exc.orig)
    )


def _preflight(settings: Any, *, broker: bool) -> None:
    """Refuse to start on a misconfiguration, before anything runs: the development secrets
    against PostgreSQL, a contract for an unknown kind, a database that does not answer or is
    not migrated, a broker that does not answer. Each is one line naming what to fix."""
    from outbox.db import check_schema
    from outbox.kinds import default_registry

    found = settings.development_secrets()
    if found:
        raise click.ClickException(
            f"refusing to start against PostgreSQL with the development value of "
            f"{' and '.join(found)}: set your own (or SETTLED_DEVELOPMENT=1 on a development "
            "machine)"
        )
    settings.apply_contracts(default_registry())
    check_schema(settings.database_url)
    if broker:
        from settled.celery_app import check_broker

        check_broker(settings)


class _Text(click.types.StringParamType):
    """A string that the database and the network can carry: valid UTF-8 (a byte that is not
    arrives as a lone surrogate), no NUL, at most ``max_length`` characters."""

    name = "text"

    def __init__(self, max_length: int = 2000) -> None:
        self.max_length = max_length

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = super().convert(value, param, ctx)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            self.fail("is not valid UTF-8 text", param, ctx)
        if "\x00" in text:
            self.fail("contains a NUL character", param, ctx)
        if len(text) > self.max_length:
            self.fail(f"is longer than {self.max_length} characters", param, ctx)
        return text


class _Seconds(click.types.FloatParamType):
    """A finite, non-negative number of seconds that a ``timedelta`` can hold."""

    name = "seconds"
    largest = 100 * 365 * 86400.0

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds) or not 0 <= seconds <= self.largest:
            self.fail(f"must be between 0 and {self.largest:.0f} seconds", param, ctx)
        return seconds


TEXT = _Text()
ITEM_ID = click.IntRange(1, BIGINT_MAX)
PORT = click.IntRange(1, 65535)
CONCURRENCY = click.IntRange(1, 256)


@click.group(cls=_OneLineErrors)
@click.version_option(package_name="settled", prog_name="settled")
def main() -> None:
    """Settled: safe side-effecting operations."""
    from outbox import logs

    # JSON lines (SETTLED_LOG_FORMAT); a person's command shows warnings unless
    # SETTLED_LOG_LEVEL says otherwise (worker, beat, web and simulator: INFO).
    logs.configure(default_level="WARNING")


@main.group()
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


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, type=TEXT)
@click.option("--port", default=8700, show_default=True, type=PORT)
@click.option(
    "--ledger",
    default="simulator.sqlite3",
    show_default=True,
    type=TEXT,
    help="ledger URL or SQLite path",
)
@click.option("--test-mode", is_flag=True, help="enable the control API (fault rules, ledger)")
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    type=TEXT,
    metavar="NAME=API_KEY",
    envvar="SETTLED_SIMULATOR_TENANTS",
    help="register a tenant and its API key (repeatable; env: space-separated)",
)
def simulator(host: str, port: int, ledger: str, test_mode: bool, tenants: tuple[str, ...]) -> None:
    """Run the payment service simulator."""
    from settled.simulator import run

    keys: dict[str, str] = {}
    for spec in tenants:
        name, sep, key = spec.partition("=")
        if not sep or not name or not key:
            raise click.BadParameter("expected NAME=API_KEY", param_hint="--tenant")
        keys[name] = key
    click.echo(f"simulator on http://{host}:{port} (test mode: {'on' if test_mode else 'off'})")
    run(host=host, port=port, ledger=ledger, test_mode=test_mode, tenants=keys)


LOGLEVEL = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False)


@main.command()
@click.option("--beat/--no-beat", default=False, help="also run beat (sweeper, reconciler)")
@click.option(
    "--pool",
    default="prefork",
    show_default=True,
    type=click.Choice(["prefork", "solo", "threads"]),
)
@click.option("--concurrency", default=2, show_default=True, type=CONCURRENCY)
@click.option(
    "--loglevel", default="INFO", show_default=True, type=LOGLEVEL, envvar="SETTLED_LOG_LEVEL"
)
@click.option("--hostname", default=None, type=TEXT, help="Celery node name")
def worker(beat: bool, pool: str, concurrency: int, loglevel: str, hostname: str | None) -> None:
    """Run a Celery worker on the submit queue (claim, send, record).

    Exits non-zero whenever the worker ends other than by a stop signal (Celery's
    "Unrecoverable error" included), so that a supervisor restarts it.
    """
    from outbox import logs
    from outbox.settings import Settings
    from settled.celery_app import create_app, worker_argv

    settings = Settings()
    logs.configure(loglevel)
    _preflight(settings, broker=True)
    if beat:
        _beat_folder(settings)
    if settings.metrics_port is not None:
        _serve_metrics(settings)
    app = create_app(settings)
    argv = worker_argv(
        beat=beat, pool=pool, concurrency=concurrency, loglevel=loglevel, hostname=hostname
    )
    raise SystemExit(_run_worker(app, argv))


def _run_worker(app: Any, argv: list[str]) -> int:
    """Run Celery's worker command; return the worker's exit status.

    ``app.worker_main`` and ``app.start`` return nothing: Celery's command line runs with
    ``standalone_mode=False``, so click returns the status that ``ctx.exit`` gave it, and
    ``start`` drops it. The worker object, which keeps it, is taken from ``worker_init``.
    """
    from celery.signals import worker_init

    workers: list[Any] = []

    def keep(sender: Any, **_: Any) -> None:
        workers.append(sender)

    worker_init.connect(keep, weak=False)
    try:
        app.start(argv)
    finally:
        worker_init.disconnect(keep)
    if not workers:
        return 1  # the worker was never built: Celery refused the command
    status = workers[-1].exitcode  # 1 after "Unrecoverable error", 0 after a stop signal
    return status if isinstance(status, int) else 0


def _serve_metrics(settings: Any) -> None:
    """Serve Prometheus metrics from this (the worker's main) process, read from the database."""
    import os

    from prometheus_client import start_http_server
    from sqlalchemy.orm import sessionmaker

    from outbox.db import make_engine
    from settled.metrics import registry

    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    # Pool children must not share this engine's connections.
    os.register_at_fork(after_in_child=lambda: engine.dispose(close=False))
    start_http_server(
        settings.metrics_port, addr=settings.metrics_host, registry=registry(sessionmaker(engine))
    )


@main.command()
@click.option(
    "--loglevel", default="INFO", show_default=True, type=LOGLEVEL, envvar="SETTLED_LOG_LEVEL"
)
def beat(loglevel: str) -> None:
    """Run celery beat: the sweeper and the reconciler on their schedules (run one)."""
    from outbox import logs
    from outbox.settings import Settings
    from settled.celery_app import create_app

    logs.configure(loglevel)
    settings = Settings()
    _preflight(settings, broker=True)
    _beat_folder(settings)
    # Beat returns when a stop signal ends it; any failure is raised (exit status 1).
    create_app(settings).start(["beat", f"--loglevel={loglevel}"])


def _beat_folder(settings: Any) -> None:
    """Create the folder of beat's state file: beat cannot start without it (and then nothing
    sweeps or reconciles)."""
    from pathlib import Path

    Path(settings.beat_schedule_file).parent.mkdir(parents=True, exist_ok=True)


def _runtime() -> Any:
    from outbox.settings import Settings
    from settled.runtime import build_runtime

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
    click.option(
        "--staff", envvar="SETTLED_STAFF_ID", required=True, type=TEXT, help="your staff id"
    ),
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

    who = Staff.parse(staff, role)
    rt = _runtime()
    try:
        return action(rt.review, who)
    finally:
        rt.close()


@review.command("list")
@click.option("--tenant", default=None, type=TEXT)
@click.option("--reason", default=None, type=TEXT)
@click.option("--older-than", type=_Seconds(), default=None, help="seconds")
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
@click.argument("item", type=ITEM_ID)
@with_staff
def review_show(item: int, staff: str, role: str, as_json: bool) -> None:
    """One item: the operation, its attempts, lookups and events."""
    _emit(_as_staff(staff, role, lambda q, who: q.show(who, item)), True)


@review.command("requery")
@click.argument("item", type=ITEM_ID)
@with_staff
def review_requery(item: int, staff: str, role: str, as_json: bool) -> None:
    """Ask the downstream again now."""
    _emit(_as_staff(staff, role, lambda q, who: q.requery(who, item)), True)


@review.command("resolve")
@click.argument("item", type=ITEM_ID)
@click.option("--as", "outcome", required=True, type=click.Choice(["succeeded", "rejected"]))
@click.option(
    "--version",
    required=True,
    type=click.IntRange(1, INT_MAX),
    help="the item version you read (show)",
)
@click.option("--reference", default=None, type=TEXT, help="downstream reference (for succeeded)")
@click.option("--justification", default=None, type=TEXT, help="why (required for rejected)")
@click.option(
    "--override",
    is_flag=True,
    help="supervisor: record it as your statement where the downstream's lookup cannot tell "
    "(needs --justification; recorded as an override)",
)
@with_staff
def review_resolve(
    item: int,
    outcome: str,
    version: int,
    reference: str | None,
    justification: str | None,
    override: bool,
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
            override=override,
        ),
    )
    _emit(result, True)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, type=TEXT)
@click.option("--port", default=8000, show_default=True, type=PORT)
def web(host: str, port: int) -> None:
    """Run the status API (run reports, cancel, operations; OpenAPI at /openapi.json) and
    /healthz, /metrics."""
    from outbox.settings import Settings
    from settled.web import serve

    settings = Settings()
    _preflight(settings, broker=False)
    click.echo(f"status API on http://{host}:{port}")
    serve(settings, host=host, port=port)


@main.group()
def apikey() -> None:
    """API keys of the status API (one tenant per key; stored hashed)."""


def _in_transaction(action: Any) -> Any:
    """Run ``action(session)`` in one transaction on the configured database."""
    from sqlalchemy.orm import Session

    from outbox.db import make_engine
    from outbox.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        with Session(engine) as session, session.begin():
            return action(session)
    finally:
        engine.dispose()


@apikey.command("create")
@click.option("--tenant", required=True, type=TEXT)
def apikey_create(tenant: str) -> None:
    """Create a key for TENANT and print it once (it cannot be shown again); its id goes to
    stderr."""
    from outbox.apikeys import create_api_key

    def create(session: Any) -> tuple[str, str]:
        row, key = create_api_key(session, tenant=tenant)
        return row.key_id, key

    key_id, key = _in_transaction(create)
    click.echo(f"key id: {key_id}", err=True)
    click.echo(key)


@apikey.command("revoke")
@click.argument("key_id", type=_Text(max_length=64))
def apikey_revoke(key_id: str) -> None:
    """Revoke the key whose id is KEY_ID."""
    from outbox.apikeys import revoke_api_key

    _in_transaction(lambda session: revoke_api_key(session, key_id))
    click.echo("revoked")


@main.command()
@click.option("--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True)
@click.option("--keep", default=None, type=TEXT, help="keep the demo's files in this folder")
def demo(lang: str, keep: str | None) -> None:
    """Play the cases a payment team meets, on the embedded default (nothing to install)."""
    from settled.demo import run_demo

    raise SystemExit(run_demo(lang=lang, keep=keep, echo=click.echo))


def run_children(*, web_host: str, web_port: int, concurrency: int) -> list[list[str]]:
    """The ``settled`` commands ``settled run`` supervises."""
    return [
        ["worker", "--pool=prefork", f"--concurrency={concurrency}"],
        ["beat"],
        ["web", f"--host={web_host}", f"--port={web_port}"],
    ]


@main.command("run")
@click.option(
    "--web-host",
    default="127.0.0.1",
    show_default=True,
    type=TEXT,
    help="interface web listens on (0.0.0.0: every interface, e.g. in a container)",
)
@click.option("--web-port", default=8000, show_default=True, type=PORT)
@click.option("--concurrency", default=2, show_default=True, type=CONCURRENCY)
def run_stack(web_host: str, web_port: int, concurrency: int) -> None:
    """Worker, beat and web for a single machine, against the configured PostgreSQL and Redis.

    A child that dies is restarted with back-off (said on stderr); SIGTERM stops them all.
    """
    from settled.supervise import settled_command, supervise

    children = run_children(web_host=web_host, web_port=web_port, concurrency=concurrency)
    raise SystemExit(supervise([settled_command(*args) for args in children]))


if __name__ == "__main__":
    main(prog_name="settled")
