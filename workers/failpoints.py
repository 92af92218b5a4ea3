"""Crash points for fault-injection tests: kill this process at a named step, once.

Off unless ``SETTLED_FAILPOINT`` names a step. ``SETTLED_FAILPOINT_MARKER`` is a file that is
created just before the kill, so the restarted process runs through the same step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

STEPS = ("after_claim", "after_send", "after_outcome")


def failpoint(step: str) -> None:
    """SIGKILL this process if the configured failpoint is ``step`` and has not fired yet."""
    if os.environ.get("SETTLED_FAILPOINT") != step:
        return
    marker = os.environ.get("SETTLED_FAILPOINT_MARKER")
    if marker:
        path = Path(marker)
        if path.exists():
            return
        path.write_text(step)
    os.kill(os.getpid(), signal.SIGKILL)
