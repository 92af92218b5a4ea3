"""Crash points for fault-injection tests: kill this process at a named step, once.

Off unless ``SETTLED_FAILPOINT`` names a step. ``SETTLED_FAILPOINT_MARKER`` is a file that is
created just before the kill, so the restarted process runs through the same step.

In-process tests (a simulation driving several services in one process) ``arm`` a step
instead: the next time this thread reaches it, ``FailpointHit`` is raised there (the worker
"dies" at that step, its leases left to lapse), or the action given is run (a pause).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STEPS = ("after_claim", "after_send", "after_outcome")

_armed = threading.local()


class FailpointHit(BaseException):
    """The armed failpoint was reached: the worker stops here, as if killed.

    A ``BaseException``, so that no ``except Exception`` of the code under test survives it.
    """

    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


@contextmanager
def arm(step: str, action: Callable[[], None] | None = None) -> Iterator[None]:
    """Within the block, the first time this thread reaches ``step``: run ``action``, or raise
    ``FailpointHit`` when there is none. Fires once."""
    if step not in STEPS:
        raise ValueError(f"no such failpoint: {step!r} (one of {', '.join(STEPS)})")
    previous = getattr(_armed, "step", None)
    _armed.step = (step, action)
    try:
        yield
    finally:
        _armed.step = previous


def failpoint(step: str) -> None:
    """SIGKILL this process if the configured failpoint is ``step`` and has not fired yet
    (or, where this thread ``arm``ed ``step``, raise or pause there)."""
    armed = getattr(_armed, "step", None)
    if armed is not None and armed[0] == step:
        _armed.step = None
        action = armed[1]
        if action is None:
            raise FailpointHit(step)
        action()
        return
    if os.environ.get("SETTLED_FAILPOINT") != step:
        return
    marker = os.environ.get("SETTLED_FAILPOINT_MARKER")
    if marker:
        path = Path(marker)
        if path.exists():
            return
        path.write_text(step)
    os.kill(os.getpid(), signal.SIGKILL)
