"""``settled reconcile``: reconcile passes on demand (beat runs them on a schedule)."""

from __future__ import annotations

import json

import click

from settled.cli.common import runtime


@click.command()
@click.option("--once", is_flag=True, help="run one pass, print its report and exit")
def reconcile(once: bool) -> None:
    """Run reconcile passes now (beat runs them on a schedule); ``--once`` for operators."""
    import time

    rt = runtime(probe=True)  # it trusts a "not found" by the declared fences
    try:
        while True:
            click.echo(json.dumps(rt.reconciler.run_once().as_dict()))
            if once:
                return
            time.sleep(rt.settings.reconcile_seconds)
    finally:
        rt.close()
