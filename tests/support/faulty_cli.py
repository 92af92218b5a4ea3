"""The real ``settled`` command line with one fault injected, for tests of how its processes end.

``python tests/support/faulty_cli.py FAULT ARGS...`` installs FAULT and runs ``settled ARGS``
in this process, exactly as the ``settled`` script does. Faults:

- ``consumer_raises``: the worker's consumer loop raises once it is connected to the broker
  (what Celery then reports as "Unrecoverable error", like the AttributeError of issue 13);
- ``scheduler_raises``: beat's scheduler raises on its first tick.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


def _raise(*_: Any, **__: Any) -> NoReturn:
    raise InjectedFault("injected by tests/support/faulty_cli.py")


def install(fault: str) -> None:
    if fault == "consumer_raises":
        from celery.worker import loops

        # The consumer picks its loop from this module when it is built, after this patch.
        loops.asynloop = _raise
        loops.synloop = _raise
    elif fault == "scheduler_raises":
        from celery import beat

        beat.Scheduler.tick = _raise  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from settled.cli import main

    main(args=sys.argv[2:], prog_name="settled")
