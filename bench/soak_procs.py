"""The fault soak's processes (``bench/soak.py``): shared constants, the process table read
from /proc, the timeline of faults, and the services the supervisor keeps running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

TERMINAL = ("succeeded", "rejected", "cancelled")
DATABASE = "settled_soak"
HOST = socket.gethostname()  # a worker's lease owner is "<hostname>:<pid>" (settled.runtime)
#: The product's default lease (``SETTLED_LEASE_SECONDS`` is not set for the workers).
LEASE_SECONDS = float(Settings.model_fields["lease_seconds"].default)

UNSETTLED = f"""
SELECT count(*) FROM operations o
WHERE o.state NOT IN {TERMINAL}
  AND NOT EXISTS (
    SELECT 1 FROM review_items r WHERE r.operation_id = o.id AND r.resolved_at IS NULL)
"""


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


# -- processes --------------------------------------------------------------------------------


def proc_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process on the machine, from /proc
    (zombies, killed but not yet reaped by their parent, left out)."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            table.append((int(entry), int(fields[1]), int(fields[2])))
    return table


def group_pids(pgid: int) -> list[int]:
    return sorted(pid for pid, _, group in proc_table() if group == pgid)


def child_pids(parent: int) -> list[int]:
    return sorted(pid for pid, ppid, _ in proc_table() if ppid == parent)


def age(pid: int) -> float:
    """Seconds since process ``pid`` started (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return uptime - started


#: A prefork child is killed only once this old: Celery ends the whole worker ("Could not start
#: worker processes") when a child dies while the pool is still starting, which is a group kill.
CHILD_MIN_AGE = 8.0


class Timeline:
    """Every fault, kill and restart as JSON lines: seconds since the start, kind, target, pid."""

    def __init__(self, path: Path, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self._file = path.open("w")
        self._lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def record(
        self, kind: str, target: str, pid: int | None = None, **extra: Any
    ) -> dict[str, Any]:
        with self._lock:
            event = {"t": self.now(), "kind": kind, "target": target, "pid": pid, **extra}
            self.events.append(event)
            self._file.write(json.dumps(event, default=str) + "\n")
            self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()


@dataclass
class Service:
    """A process (or server) the supervisor keeps running."""

    name: str
    starter: Callable[[Service], int]  # starts it; returns its pid
    alive: Callable[[Service], bool]
    proc: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    stopped: bool = False  # SIGSTOPped by the chaos loop: not dead, not to be restarted
    killed: bool = False  # taken down by the chaos loop (not an unexpected exit)
    down_since: float | None = None
    starts: int = 0

    def start(self) -> int:
        self.pid = self.starter(self)
        self.starts += 1
        self.killed = False
        self.down_since = None
        return self.pid

    def running(self) -> bool:
        return self.alive(self)


def popen_alive(svc: Service) -> bool:
    return svc.proc is not None and svc.proc.poll() is None
