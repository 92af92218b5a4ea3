"""``settled run``: worker, beat and web for a single machine, as child processes.

Each child is an ordinary ``settled`` command. It says when it is ready (``say_ready``: its
preflight passed and it serves: the worker consumes, beat schedules, web listens) on a pipe
the supervisor gives it (``READY_FD``). A child that exits before it was ever ready failed its
preflight or its start (database down, no secrets, port taken): that will not mend by itself,
so the supervisor stops the others and exits with that child's status. A child that dies after
it was ready is restarted (after 1 s, doubling up to 30 s while it keeps dying soon after its
start; a child that ran a minute counts as healthy again), and said so on stderr. On SIGINT or
SIGTERM it stops them all and exits: 0 when every child stopped cleanly.
"""

from __future__ import annotations

import contextlib
import os
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
#: How long the children have to stop after SIGTERM before they are killed.
STOP_SECONDS = 30.0
#: Asks a child to write every thread's stack on stderr (``faulthandler``; ``settled.cli``
#: registers it in every command), so that one that would not stop says where it hung.
STACKS_SIGNAL = signal.SIGUSR1


#: The environment variable naming the pipe a child says it is ready on.
READY_FD = "SETTLED_RUN_READY_FD"


def say_ready() -> None:
    """Tell the supervising ``settled run`` (if any) that this process is ready; once."""
    fd = os.environ.pop(READY_FD, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"ready\n")
        os.close(int(fd))
    except (OSError, ValueError):
        pass  # not started by ``settled run`` after all: nobody to tell


def _dump_stacks(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(STACKS_SIGNAL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(1.0)  # time to write them (it stays alive: the handler only writes)


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
    #: it said it was ready, since ``settled run`` started (once is enough)
    was_ready: bool = False
    _ready_pipe: int | None = None

    @property
    def name(self) -> str:
        return " ".join(self.command[3:]) or self.command[-1]

    def start(self, now: float) -> None:
        read, write = os.pipe()
        os.set_blocking(read, False)
        env = {**os.environ, READY_FD: str(write)}
        try:
            self.proc = subprocess.Popen(self.command, env=env, pass_fds=(write,))  # noqa: S603 - our own commands
        finally:
            os.close(write)
        self.close_pipe()
        self._ready_pipe = read
        self.started, self.restart_at = now, None

    def close_pipe(self) -> None:
        if self._ready_pipe is not None:
            os.close(self._ready_pipe)
            self._ready_pipe = None

    def _read_ready(self) -> None:
        if self._ready_pipe is None:
            return
        try:
            said = os.read(self._ready_pipe, 64)
        except BlockingIOError:
            return
        if said:
            self.was_ready = True
        self.close_pipe()  # said, or closed without a word: nothing more will come

    def check(self, now: float, say: Callable[[str], None]) -> int | None:
        """Restart the child when it is due; schedule a restart when it died after it was
        ready. Returns its exit status when it died before it was ever ready (None: go on)."""
        if self.proc is None:
            if self.restart_at is not None and now >= self.restart_at:
                self.restarts += 1
                say(f"restarting {self.name} (restart {self.restarts})")
                self.start(now)
            return None
        status = self.proc.poll()
        self._read_ready()  # after the poll: what it said before it exited is read too
        if status is None:
            return None
        if not self.was_ready:
            say(f"{self.name} exited with status {status} before it was ready; stopping")
            self.proc = None
            self.close_pipe()
            return status if status > 0 else 1  # killed by a signal: a failure too
        if now - self.started >= HEALTHY_AFTER:
            self.delay = FIRST_DELAY
        say(f"{self.name} exited with status {status}; restarting in {self.delay:g} s")
        self.proc, self.restart_at = None, now + self.delay
        self.delay = min(MAX_DELAY, self.delay * 2)
        return None


def supervise(
    commands: Sequence[Sequence[str]],
    *,
    poll: float = 0.5,
    say: Callable[[str], None] = _say,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run ``commands``, restarting any that dies after it was ready, until a stop signal or a
    child that exits before it was ever ready; return an exit status (that child's)."""
    children = [_Child(list(cmd)) for cmd in commands]
    for child in children:
        child.start(clock())
    stopping = False
    failed_start: int | None = None

    def _stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping and failed_start is None:
            for child in children:
                failed_start = child.check(clock(), say)
                if failed_start is not None:
                    break
            else:
                time.sleep(poll)
    finally:
        procs = [c.proc for c in children if c.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child = next(c for c in children if c.proc is p)
                say(f"{child.name} did not stop within {STOP_SECONDS:g} s; its stacks, then kill")
                _dump_stacks(p)
                p.kill()
                p.wait()
        for child in children:
            child.close_pipe()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed_start is not None:
        return failed_start
    failed = [
        c for c in children if c.proc is not None and c.proc.returncode not in (0, -signal.SIGTERM)
    ]
    for child in failed:
        assert child.proc is not None
        say(f"{child.name} exited with status {child.proc.returncode} while stopping")
    return 1 if failed else 0
