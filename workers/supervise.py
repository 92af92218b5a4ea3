"""``settled run``: worker, beat and web for a single machine, as child processes.

Each child is an ordinary ``settled`` command; this only starts them, forwards SIGINT and
SIGTERM, and stops the rest (exiting non-zero) as soon as one of them dies.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType


def settled_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox.cli", *args]


def supervise(commands: Sequence[Sequence[str]], *, poll: float = 0.5) -> int:
    """Run ``commands`` until one exits or a stop signal arrives; return an exit status."""
    procs = [subprocess.Popen(list(cmd)) for cmd in commands]  # noqa: S603 - our own commands
    stopping = False

    def _stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(poll)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [p.returncode for p in procs if p.returncode not in (0, -signal.SIGTERM)]
    return 0 if stopping and not failed else 1
