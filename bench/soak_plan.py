"""The seeded plans of the fault soak (``bench/soak.py``): what is killed when, which downstream
faults are drawn, and what each producer enqueues. Pure functions of the seed and the sizes: the
same seed gives the same plans, so a run can be repeated for a post-mortem."""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any

#: Process faults the chaos loop injects (each at least once in every run).
KILLS = (
    "kill_worker_group",  # SIGKILL a worker's whole process group (main process and children)
    "kill_worker_child",  # SIGKILL one prefork child (the main process forks a new one)
    "kill_beat",  # SIGKILL a beat process
    "stop_worker",  # SIGSTOP a worker's group for longer than its lease, then SIGCONT
    "kill_redis",  # SIGKILL Redis; it comes back empty (no persistence)
    "restart_postgres",  # pg_ctl stop -m immediate (a crash), then start (WAL recovery)
    "flush_redis",  # FLUSHALL: every queued hint and unacked message gone
)
#: Relative frequency of the repeated ones (stops and outages are placed apart, see below).
WEIGHTS = {
    "kill_worker_group": 3.0,
    "kill_worker_child": 3.0,
    "kill_beat": 1.0,
    "kill_redis": 1.5,
    "restart_postgres": 1.5,
    "flush_redis": 1.5,
}
WORKERS = ("w1", "w2")
BEATS = ("b1", "b2")

#: Downstream faults drawn by the simulator's seeded schedule during the chaos window, per
#: request (submit phase) or lookup (lookup phase). 429 answers with ``Retry-After: 1``.
DOWNSTREAM = {
    "commit_then_timeout": 0.01,
    "commit_then_reset": 0.02,
    "503_before": 0.02,
    "503_after_commit": 0.02,
    "429": 0.03,
    "lookup_unavailable": 0.10,
}
#: The downstream faults a run must have seen (the schedule above, and the outages).
DOWNSTREAM_KINDS = tuple(DOWNSTREAM)

TENANTS = ("acme", "globex")
BIG_ORDERS = 40  # per tenant: refunds on them always fit
SMALL_ORDER_MINOR = 20_000  # two small orders per tenant fill up: later refunds are refused
MAX_BATCH = 20


@dataclass(frozen=True)
class Action:
    """One step of the chaos loop, ``at`` seconds after the production started."""

    at: float
    kind: str  # a KILLS kind, "resume_worker", "lookup_outage_begin", "lookup_outage_end"
    target: str  # w1, w2, b1, b2, redis, postgres, downstream
    #: kill_worker_child: which child (index modulo the children found); stop_worker and its
    #: resume_worker: the same number, pairing them
    pick: int = 0
    length: float = 0.0  # stop_worker and lookup_outage_begin: seconds until the end action

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def secret(seed: int, label: str, length: int = 64) -> str:
    """A hex secret derived from the seed: real-looking, never a development default, and the
    same for the same seed (idempotency keys, and so the simulator's fault draws, repeat)."""
    return hashlib.sha256(f"settled-soak\x00{seed}\x00{label}".encode()).hexdigest()[:length]


def chaos_schedule(
    seed: int,
    duration: float,
    *,
    stop_seconds: float,
    warmup: float = 4.0,
    mean_gap: float = 4.0,
) -> list[Action]:
    """The process faults and lookup outages of a ``duration``-second chaos window.

    Every kind of ``KILLS`` happens at least once, and the outage at least once. Worker stops
    never overlap and end inside the window; while a group is stopped, group kills and child
    kills go to the other group (the stopped one is resumed, not killed). Everything else
    lands on a jittered grid of about one action every ``mean_gap`` seconds.
    """
    rng = random.Random(f"chaos\x00{seed}")
    end = duration
    actions: list[Action] = []

    # Stops first: they take the longest and need room before the window ends.
    stops: list[tuple[float, float, str]] = []
    wanted = max(1, round(duration / 150))
    room = end - warmup - stop_seconds - 1.0
    if room < 0:
        raise ValueError(
            f"a {duration:.0f} s chaos window has no room for a {stop_seconds:.0f} s worker stop"
        )
    for _ in range(wanted * 20):
        if len(stops) == wanted:
            break
        start = warmup + rng.uniform(0, room)
        if all(abs(start - s) > stop_seconds + 2 for s, _, _ in stops):
            stops.append((start, start + stop_seconds, rng.choice(WORKERS)))
    for i, (start, stop_end, target) in enumerate(stops):
        actions.append(Action(round(start, 3), "stop_worker", target, i, stop_seconds))
        actions.append(Action(round(stop_end, 3), "resume_worker", target, i))

    # Lookup outages: 4-8 s each, apart from each other.
    outages: list[tuple[float, float]] = []
    wanted = max(1, round(duration / 60))
    for _ in range(wanted * 20):
        if len(outages) == wanted:
            break
        length = rng.uniform(4.0, 8.0)
        start = warmup + rng.uniform(0, max(0.0, end - warmup - length - 1.0))
        if all(start > e + 2 or start + length < s - 2 for s, e in outages):
            outages.append((start, start + length))
    for start, out_end in outages:
        actions.append(
            Action(round(start, 3), "lookup_outage_begin", "downstream", length=out_end - start)
        )
        actions.append(Action(round(out_end, 3), "lookup_outage_end", "downstream"))

    # The other faults: each kind once, the rest drawn by weight, on a jittered grid.
    count = max(len(WEIGHTS), int((end - 1.0 - warmup) / mean_gap))
    kinds = list(WEIGHTS)
    names, weights = zip(*WEIGHTS.items(), strict=True)
    kinds += rng.choices(names, weights=weights, k=count - len(kinds))
    rng.shuffle(kinds)
    step = (end - 1.0 - warmup) / count
    for i, kind in enumerate(kinds):
        at = warmup + (i + rng.uniform(0.1, 0.9)) * step
        stopped = {t for s, e, t in stops if s - 1 <= at <= e + 1}
        if kind in ("kill_worker_group", "kill_worker_child"):
            free = [w for w in WORKERS if w not in stopped] or list(WORKERS)
            target = rng.choice(free)
        elif kind == "kill_beat":
            target = rng.choice(BEATS)
        elif kind == "restart_postgres":
            target = "postgres"
        else:
            target = "redis"
        actions.append(Action(round(at, 3), kind, target, pick=rng.randrange(1000)))
    return sorted(actions, key=lambda a: (a.at, a.kind))


@dataclass(frozen=True)
class Job:
    """One intake transaction of a producer, and what it schedules after it.

    ``single``: one refund; ``batch``: ``size`` refunds in one transaction; ``after_sales``: a
    run with a ticket, then a pickup in a later transaction, maybe a cancel of the run, maybe
    a compensation of the ticket (a ``ticket_cancel``; a plain refund if the ticket is found
    rejected or cancelled, or its run cancelled, by then).
    """

    first: int  # number of the job's first operation in the producer's sequence
    kind: str
    tenant: str
    size: int  # operations the job enqueues, all transactions included
    pickup_after: float = 0.0
    cancel_after: float | None = None
    compensate_after: float | None = None


def producer_jobs(seed: int, producer: int, quota: int) -> list[Job]:
    """Jobs enqueueing exactly ``quota`` operations: about 35 % in one-operation transactions,
    35 % in batches of 2-20, 30 % in after-sales runs."""
    rng = random.Random(f"producer\x00{seed}\x00{producer}")
    jobs: list[Job] = []
    n = 0
    while n < quota:
        left = quota - n
        tenant = rng.choice(TENANTS)
        draw = rng.random()
        if draw < 0.55 or left == 1:
            job = Job(n, "single", tenant, 1)
        elif draw < 0.7:
            job = Job(n, "batch", tenant, min(left, rng.randint(2, MAX_BATCH)))
        else:
            compensate = rng.random() < 0.3 and left >= 3
            job = Job(
                n,
                "after_sales",
                tenant,
                3 if compensate else 2,
                pickup_after=rng.uniform(0.3, 1.5),
                cancel_after=rng.uniform(0.0, 2.5) if rng.random() < 0.2 else None,
                compensate_after=rng.uniform(1.0, 4.0) if compensate else None,
            )
        jobs.append(job)
        n += job.size
    return jobs


def refund_params(rng: random.Random, tenant: str) -> dict[str, Any]:
    """A refund on one of the tenant's orders: mostly large ones, some small ones that fill up
    (refused: more than refundable), a few on the closed order (refused: order closed)."""
    draw = rng.random()
    if draw < 0.93:
        order = f"O-{rng.randrange(BIG_ORDERS)}"
    elif draw < 0.98:
        order = f"S-{rng.randrange(2)}"
    else:
        order = "C-0"
    return {
        "order_id": order,
        "amount_minor": rng.randint(100, 5000),
        "currency": "CNY",
        "payee": f"P-{rng.randrange(500)}",
    }


def orders() -> list[tuple[str, str, int, bool]]:
    """(tenant, order id, amount in minor units, closed) of every order the simulator needs."""
    out: list[tuple[str, str, int, bool]] = []
    for tenant in TENANTS:
        out += [(tenant, f"O-{i}", 10**12, False) for i in range(BIG_ORDERS)]
        out += [(tenant, f"S-{i}", SMALL_ORDER_MINOR, False) for i in range(2)]
        out.append((tenant, "C-0", 10**6, True))
    return out
