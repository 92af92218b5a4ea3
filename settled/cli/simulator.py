"""``settled simulator``: the payment service stand-in (``settled.simulator``)."""

from __future__ import annotations

import click

from settled.cli.common import PORT, TEXT


@click.command()
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
@click.option(
    "--deadline-fence/--no-deadline-fence",
    default=True,
    show_default=True,
    help="refuse submits that arrive after their Settled-Deadline (408 deadline_exceeded)",
)
def simulator(
    host: str,
    port: int,
    ledger: str,
    test_mode: bool,
    tenants: tuple[str, ...],
    deadline_fence: bool,
) -> None:
    """Run the payment service simulator."""
    from settled.simulator import run

    keys: dict[str, str] = {}
    for spec in tenants:
        name, sep, key = spec.partition("=")
        if not sep or not name or not key:
            raise click.BadParameter("expected NAME=API_KEY", param_hint="--tenant")
        keys[name] = key
    click.echo(f"simulator on http://{host}:{port} (test mode: {'on' if test_mode else 'off'})")
    run(
        host=host,
        port=port,
        ledger=ledger,
        test_mode=test_mode,
        tenants=keys,
        deadline_fence=deadline_fence,
    )
