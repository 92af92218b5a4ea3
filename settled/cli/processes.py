"""The long-running processes: ``worker``, ``beat``, ``web`` and ``run`` (the three under one
supervisor), the checks each makes before it starts (``settled.preflight``), and ``check``,
which makes them alone."""

from __future__ import annotations

from typing import Any

import click

from settled.cli.common import CONCURRENCY, LOGLEVEL, PORT, TEXT


def _preflight(settings: Any, command: str, *, broker: bool, probe: bool = False) -> None:
    """Refuse to start on a misconfiguration, before anything runs (``settled.preflight``:
    one line naming what to fix; ``probe``: a process that sends or settles by itself, whose
    declared deadline fences are probed); then say, in one line, what this start runs
    against."""
    from settled.preflight import announce, preflight

    announce(preflight(settings, broker=broker, probe=probe), command)


@click.command()
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
    _preflight(settings, "worker", broker=True, probe=True)
    if beat:
        _beat_folder(settings)
    if settings.metrics_port is not None:
        _serve_metrics(settings)
    # On the thread pool one process runs several submit tasks at once: their hints are
    # worked in shared batches.
    app = create_app(settings, coalesce=pool == "threads")
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
    from celery.signals import worker_init, worker_ready

    from settled.supervise import say_ready

    workers: list[Any] = []

    def keep(sender: Any, **_: Any) -> None:
        workers.append(sender)

    def ready(**_: Any) -> None:
        say_ready()  # consuming: `settled run` restarts it from now on if it dies

    worker_init.connect(keep, weak=False)
    worker_ready.connect(ready, weak=False)
    try:
        app.start(argv)
    finally:
        worker_init.disconnect(keep)
        worker_ready.disconnect(ready)
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


@click.command()
@click.option(
    "--loglevel", default="INFO", show_default=True, type=LOGLEVEL, envvar="SETTLED_LOG_LEVEL"
)
def beat(loglevel: str) -> None:
    """Run celery beat: the sweeper and the reconciler on their schedules (run one)."""
    from celery.signals import beat_init

    from outbox import logs
    from outbox.settings import Settings
    from settled.celery_app import create_app
    from settled.supervise import say_ready

    logs.configure(loglevel)
    settings = Settings()
    _preflight(settings, "beat", broker=True, probe=True)
    _beat_folder(settings)
    beat_init.connect(lambda **_: say_ready(), weak=False)
    # Beat returns when a stop signal ends it; any failure is raised (exit status 1).
    create_app(settings).start(["--quiet", "beat", f"--loglevel={loglevel}"])  # no banner


def _beat_folder(settings: Any) -> None:
    """Create the folder of beat's state file: beat cannot start without it (and then nothing
    sweeps or reconciles)."""
    from pathlib import Path

    Path(settings.beat_schedule_file).parent.mkdir(parents=True, exist_ok=True)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, type=TEXT)
@click.option("--port", default=8000, show_default=True, type=PORT)
def web(host: str, port: int) -> None:
    """Run the status API (run reports, cancel, operations; OpenAPI at /openapi.json) and
    /healthz, /metrics."""
    from outbox.settings import Settings
    from settled.web import serve

    settings = Settings()
    _preflight(settings, "web", broker=False)
    click.echo(f"status API on http://{host}:{port}")
    serve(settings, host=host, port=port)


def run_children(*, web_host: str, web_port: int, concurrency: int) -> list[list[str]]:
    """The ``settled`` commands ``settled run`` supervises."""
    return [
        ["worker", "--pool=prefork", f"--concurrency={concurrency}"],
        ["beat"],
        ["web", f"--host={web_host}", f"--port={web_port}"],
    ]


@click.command("run")
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

    The preflight runs first (one line and a non-zero exit on a misconfiguration). A child that
    exits before it was ready (its own preflight, a port taken) stops them all, with its exit
    status; one that dies after is restarted with back-off (said on stderr). SIGTERM stops
    them all.
    """
    from outbox.settings import Settings
    from settled.supervise import settled_command, supervise

    _preflight(Settings(), "run", broker=True, probe=True)
    children = run_children(web_host=web_host, web_port=web_port, concurrency=concurrency)
    raise SystemExit(supervise([settled_command(*args) for args in children]))


@click.command("check")
@click.option(
    "--broker/--no-broker",
    default=True,
    show_default=True,
    help="check that the broker answers too (web alone needs none)",
)
@click.option(
    "--probe/--no-probe",
    default=True,
    show_default=True,
    help="probe each declared deadline fence, as worker and beat do at start",
)
def check(broker: bool, probe: bool) -> None:
    """Run the preflight alone, as every start runs it (for a deploy pipeline): exit 0 and one
    line naming the database, its schema, its replication and the broker, then one line per
    kind whose declared deadline fence was probed and verified, one per host of a multi-host
    database URL with its role (primary, standby, unreachable and why), and the WARNING of a
    primary replicated asynchronously; or one ``Error:`` line and exit 1. Writes nothing;
    sends nothing but the fences' probes, which no downstream executes."""
    from outbox.db import database_hosts
    from outbox.settings import Settings
    from settled.preflight import host_lines, host_roles, preflight

    settings = Settings()
    started = preflight(settings, broker=broker, probe=probe)
    click.echo(started.line("check"))
    for line in started.fence_lines("check"):
        click.echo(line)
    if len(database_hosts(settings.database_url)) > 1:
        for line in host_lines("check", host_roles(settings.database_url)):
            click.echo(line)
    warning = started.replication_warning()
    if warning is not None:
        click.echo(f"settled check: WARNING: {warning}")
