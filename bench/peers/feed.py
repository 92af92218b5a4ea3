"""One producer process of the live-traffic and open-loop phases (``bench/phases/live.py``).

Run as ``python -m bench.peers.feed SYSTEM CONFIG_JSON``, by the interpreter of the system's
environment: it imports only the standard library and the system's ``Feed`` (``SYSTEMS``).
The protocol is JSON lines: the process commits ``warm`` refunds and writes
``{"ready": [ids]}``; it reads ``{"t0": wall clock}`` from its standard input; then it commits
one refund per transaction, either as fast as it can until ``t0 + seconds`` (closed loop), or
operation ``k`` (``k = index, index + producers, ...`` below ``count``) at ``t0 + k / rate``
(open loop); and it writes ``{"ids", "committed", "late_ms", "commits", "cpu"}``: the refunds,
when each commit returned (before the hand-off), how late each open-loop commit began, the
COMMITs it sent (warm-up included) and its own CPU seconds from ``t0`` to its last commit.
Lines of its own start with ``FEED `` (libraries may print too).
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time
from typing import Any

SYSTEMS = {
    "settled": "bench.peers.feeds:SettledFeed",
    "noop": "bench.peers.feeds:NoopFeed",
    "celery_safe": "bench.peers.celery_safe:Feed",
    "procrastinate": "bench.peers.procrastinate_peer:Feed",
    "dbos": "bench.peers.dbos_peer:Feed",
}

PREFIX = "FEED "


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    system, raw = sys.argv[1], sys.argv[2]
    cfg = json.loads(raw)
    module, _, name = SYSTEMS[system].partition(":")
    feed = getattr(importlib.import_module(module), name)(cfg)
    try:
        say({"ready": [feed.commit_one()[0] for _ in range(cfg["warm"])]})
        t0 = float(json.loads(sys.stdin.readline())["t0"])
        index, producers = cfg["index"], cfg["producers"]
        rate, count, seconds = cfg.get("rate"), cfg.get("count"), cfg.get("seconds")
        ids: list[int] = []
        committed: list[float] = []
        late: list[float] = []
        wait = t0 - time.time()
        if wait > 0:
            time.sleep(wait)
        cpu0 = cpu_seconds()
        k = index
        while True:
            if rate is not None:
                if k >= count:
                    break
                due = t0 + k / rate
                wait = due - time.time()
                if wait > 0:
                    time.sleep(wait)
                late.append((time.time() - due) * 1000)
            elif time.time() >= t0 + seconds:
                break
            op, at = feed.commit_one()
            ids.append(op)
            committed.append(at)
            k += producers
        say({"ids": ids, "committed": committed, "late_ms": late, "commits": feed.commits,
             "cpu": cpu_seconds() - cpu0})  # fmt: skip
    finally:
        feed.close()


if __name__ == "__main__":
    main()
