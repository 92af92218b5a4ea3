"""The image's health check: one script for every role the image runs.

    python /app/healthcheck.py [ROLE [OPTIONS]]

ROLE and OPTIONS are those of the ``settled`` command the container runs (``web --port=8000``);
without them they are read from the container's main command (``/proc/1/cmdline``), which is
how the Dockerfile's HEALTHCHECK calls it. Exit status 0: healthy; 1: not, with one line saying
why.

- ``web``, ``run``: ``GET /healthz`` answers 200 (the process serves and reaches the database).
- ``simulator``: its port accepts a connection.
- ``worker``: ``GET /metrics`` on ``SETTLED_METRICS_PORT`` answers 200, where that is set.
- ``beat``: beat's schedule file (``SETTLED_BEAT_SCHEDULE_FILE``) was written recently. Beat
  writes it at start and then at the first task it sends after Celery's ``sync_every``
  (180 s); the sweeper is sent every ``SETTLED_SWEEP_SECONDS``. A beat whose loop is stuck
  or dead stops writing it. A broker lost while beat runs does not stop it (beat logs each
  failed send and goes on ticking), so this checks beat, not Redis; a beat that never reached
  the broker at start is still retrying to connect, sends nothing, and is reported unhealthy.
- anything else (``db upgrade``, ``--help``): a one-shot command, healthy.
"""

from __future__ import annotations

import glob
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

#: Slack for a slow tick and the time one send to the broker may take before it gives up.
BEAT_SLACK_SECONDS = 60.0


def role_args(cmdline: bytes) -> list[str]:
    """The ``settled`` role and its options from a NUL-separated command line, or []."""
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    for i, arg in enumerate(args):
        if Path(arg).name == "settled":
            return args[i + 1 :]
    return []


def option(args: list[str], name: str, default: int) -> int:
    """The value of ``--name=N`` or ``--name N`` in ``args``."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return int(arg.split("=", 1)[1])
        if arg == name and i + 1 < len(args):
            return int(args[i + 1])
    return default


def http_ok(port: int, path: str) -> str | None:
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            status = response.status
    except OSError as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: status {status}"


def port_open(port: int) -> str | None:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
    except OSError as exc:
        return f"port {port}: {exc}"
    return None


def beat_max_age(env: dict[str, str]) -> float:
    """Longest beat may go without writing its schedule file while it is healthy."""
    from celery.beat import Scheduler

    sweep = float(env.get("SETTLED_SWEEP_SECONDS", "1"))
    reconcile = float(env.get("SETTLED_RECONCILE_SECONDS", "10"))
    return float(Scheduler.sync_every) + min(sweep, reconcile) + BEAT_SLACK_SECONDS


def beat_fresh(env: dict[str, str], now: float) -> str | None:
    schedule = env.get("SETTLED_BEAT_SCHEDULE_FILE", "var/celerybeat-schedule")
    # The dbm module picks the file names: the path itself, or .db, or .dat/.dir/.bak.
    written = [os.stat(p).st_mtime for p in glob.glob(glob.escape(schedule) + "*")]
    if not written:
        return f"no beat schedule file at {schedule}"
    age = now - max(written)
    limit = beat_max_age(env)
    if age > limit:
        return f"beat schedule file {schedule} not written for {age:.0f} s (limit {limit:.0f} s)"
    return None


def check(args: list[str], env: dict[str, str]) -> str | None:
    """Why the process that ``args`` runs is unhealthy, or None."""
    role = args[0] if args else ""
    if role == "web":
        return http_ok(option(args, "--port", 8000), "/healthz")
    if role == "run":
        return http_ok(option(args, "--web-port", 8000), "/healthz")
    if role == "simulator":
        return port_open(option(args, "--port", 8700))
    if role == "worker":
        port = env.get("SETTLED_METRICS_PORT")
        return http_ok(int(port), "/metrics") if port else None
    if role == "beat":
        return beat_fresh(env, time.time())
    return None


def main() -> int:
    args = sys.argv[1:] or role_args(Path("/proc/1/cmdline").read_bytes())
    try:
        problem = check(args, dict(os.environ))
    except ValueError as exc:  # a port or period that is not a number
        problem = f"bad setting: {exc}"
    if problem:
        print(problem)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
