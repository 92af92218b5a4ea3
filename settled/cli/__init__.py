"""The ``settled`` command line: the root group and its commands, one module per group.

    common       one-line errors, the checked input types, the runtime from the settings
    processes    worker, beat, web, run (and the checks before they start), check
    db           db upgrade, db current
    ops, audit   ops list, show, resubmit, prune; ops audit (orphan effects)
    review       review list, show, requery, resolve (support staff)
    apikey       apikey create, revoke
    staff        staff create, disable, password, list (the console's accounts)
    agents       mcp (the MCP server for AI agents); proposals list, approve, decline
    reconcile    reconcile [--once]
    simulator    simulator
    demo         demo

Bad input, bad configuration and refused actions end with one line on stderr (``Error: ...``)
and a non-zero exit status, never a traceback (``common.OneLineErrors``). Every command
imports what it runs when it runs, so ``settled --help`` loads click and nothing else.
"""

from __future__ import annotations

import click

from settled.cli.agents import mcp, proposals
from settled.cli.apikey import apikey
from settled.cli.audit import ops_audit
from settled.cli.common import OneLineErrors, version_option
from settled.cli.db import db
from settled.cli.demo import demo
from settled.cli.ops import ops
from settled.cli.processes import beat, check, run_stack, web, worker
from settled.cli.reconcile import reconcile
from settled.cli.review import review
from settled.cli.simulator import simulator
from settled.cli.staff import staff

__all__ = ["main"]


@click.group(cls=OneLineErrors)
@version_option
def main() -> None:
    """Settled: safe side-effecting operations."""
    import contextlib
    import faulthandler
    import io
    import signal

    from outbox import logs

    # Every thread's stack on stderr at SIGUSR1: what `settled run` asks of a child that does
    # not stop (the worker's Celery answers it with the same, as log lines). Not where stderr
    # is no file (a command run in-process, as click's test runner does).
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    # JSON lines (SETTLED_LOG_FORMAT); a person's command shows warnings unless
    # SETTLED_LOG_LEVEL says otherwise (worker, beat, web and simulator: INFO).
    logs.configure(default_level="WARNING")


# click lists them by name, whatever the order here.
main.add_command(worker)
main.add_command(beat)
main.add_command(web)
main.add_command(run_stack)
main.add_command(db)
main.add_command(review)
main.add_command(apikey)
main.add_command(staff)
main.add_command(reconcile)
main.add_command(simulator)
main.add_command(demo)
ops.add_command(ops_audit)
main.add_command(ops)
main.add_command(mcp)
main.add_command(proposals)
main.add_command(check)
