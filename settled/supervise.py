"""``settled run``: worker, beat and web for a single machine, as child processes.

Each child is an ordinary ``settled`` command. The supervisor starts them, restarts one that
dies (after 1 s, doubling up to 30 s while it keeps dying soon after its start; a child that
ran a minute counts as healthy again) and says so on stderr, and on SIGINT or SIGTERM stops
them all and exits: 0 when every child stopped cleanly.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

#: First restart delay, its cap, and how long a child must run to count as healthy again.
FIRST_DELAY = 1.0
MAX_DELAY = 30.0
HEALTHY_AFTER = 60.0


def settled_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "settled.cli", *args]


def _say(message: str) -> None:
    print(f"settled run: {message}", file=sys.stderr, flush=True)


@dataclass
class _Child:
    command: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    delay: float = field(default_factory=lambda: FIRST_DELAY)
    restart_at: float | None = None
    restarts: int = field(default=0)

    @property
    def name(self) -> str:
        return " ".join(self.command[3:]) or self.command[-1]

    def start(self, now: float) -> None:
        self.proc = subprocess.Popen(self.command)  # noqa: S603 - our own commands
        self.started, self.restart_at = now, None

    def check(self, now: float, say: Callable[[str], None]) -> None:
        """Restart the child when it is due; schedule a restart when it has died."""
        if self.proc is None:
            if self.restart_at is not None and now >= self.restart_at:
                self.restarts += 1
                say(f"restarting {self.name} (restart {self.restarts})")
                self.start(now)
            return
        status = self.proc.poll()
        if status is None:
            return
        if now - self.started >= HEALTHY_AFTER:
            self.delay = FIRST_DELAY
        say(f"{self.name} exited with status {status}; restarting in {self.delay:g} s")
        self.proc, self.restart_at = None, now + self.delay
        self.delay = min(MAX_DELAY, self.delay * 2)


def supervise(
    commands: Sequence[Sequence[str]],
    *,
    poll: float = 0.5,
    say: Callable[[str], None] = _say,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run ``commands``, restarting any that dies, until a stop signal; return an exit status."""
    children = [_Child(list(cmd)) for cmd in commands]
    for child in children:
        child.start(clock())
    stopping = False

    def _stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping:
            for child in children:
                child.check(clock(), say)
            time.sleep(poll)
    finally:
        procs = [c.proc for c in children if c.proc is not None]
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
    return 1 if failed else 0
