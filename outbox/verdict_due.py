"""When an uncertain operation will be decided at the latest, and what it waits for.

The answers that show an ``uncertain`` operation (the run report, the status API, the console,
the MCP tools) say "asking again; decided by 12:05 at the latest". The time is a bound the
reconciler keeps, from the numbers it runs with: the quiescence rule (``outbox.quiescence``),
the review threshold and the operation's deadline (``Situation.overdue``), the longest gap
between two looks (``MAX_RECHECK``, the backoff's cap) and how late a due look may start and
finish (the beat's reconcile period and a lookup's time). Pure: no database, clock or network.

"Decided" means the operation left the reconciler's hands: settled by a receipt found,
proved not done and planned again with its same key, or put in review for support staff. Why
the bound holds: after ``X``, the latest of quiescence, the review threshold (or deadline) and
a clock step's doubt, any look decides (a receipt settles; a "not found" is trusted, or the key
is past retention and it goes to review; an unavailable lookup is overdue and goes to review).
Every look schedules the next one at most ``MAX_RECHECK`` later, or at quiescence or the
clock's trust, both at most ``X``; so the first look due at or after ``X`` is due by
``X + MAX_RECHECK``, and starts within the beat's period of being due and ends within a
lookup's time. A same-key resend settles it sooner when it is answered; one that itself goes
unanswered is a new attempt, which moves quiescence on, and the next answer gives the new bound
(a promise made before it is not kept then: at most ``max_attempts`` sends in all, each moving
it by at most its lease and the landing slack). It assumes the reconciler keeps up: a pass
takes every due operation (``SETTLED_RECONCILE_SECONDS`` periods with a backlog larger than a
pass's batch come on top), and no new step of the database's clock. An operation in review
waits for staff: no time is promised.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from outbox.kinds import DownstreamContract
from outbox.quiescence import landing_slack, quiet_at
from outbox.states import State

#: Longest the reconciler waits between two looks at one operation (the backoff's cap).
MAX_RECHECK = timedelta(minutes=5)
#: Longest one lookup of the reconciler takes, whatever the client timeout.
LONGEST_LOOKUP = timedelta(seconds=30)


class WaitsFor(enum.StrEnum):
    """What an uncertain operation waits for (the reason code of its verdict's time)."""

    SEND = "send"  # a send in flight: its answer, or the reconciler after its lease
    LOOKUP = "lookup"  # the reconciler's next lookup answers it
    QUIESCENCE = "quiescence"  # a "not found" is trusted only once no request can land
    CLOCK_STEP = "clock_step"  # a step of the database's clock is waited out first
    REVIEW = "review"  # nothing automatic can settle it: the next look hands it to staff
    STAFF = "staff"  # in review: support staff decide, no time promised


@dataclass(frozen=True)
class Cadence:
    """The numbers the reconciler runs with (``SETTLED_REVIEW_AFTER_SECONDS``,
    ``SETTLED_DOWNSTREAM_TIMEOUT``, ``SETTLED_RECONCILE_SECONDS``) and each kind's contract,
    as the composition root built them (``settled.runtime.cadence_of``)."""

    review_after: timedelta
    client_timeout: timedelta
    reconcile_every: timedelta
    contracts: Mapping[str, DownstreamContract]

    @property
    def lookup_time(self) -> timedelta:
        """Longest one lookup takes (``Reconciler.lookup_seconds``)."""
        return min(self.client_timeout, LONGEST_LOOKUP)

    @property
    def late(self) -> timedelta:
        """Longest from a look being due to its decision written: a beat period, a lookup."""
        return self.reconcile_every + self.lookup_time


@dataclass(frozen=True)
class Uncertain:
    """What is known of one uncertain operation: its row and ``OperationFacts``."""

    state: State  # UNKNOWN or SUBMITTED
    contract: DownstreamContract
    now: datetime  # database time
    deadline: datetime
    next_look_at: datetime  # ``next_attempt_at``: when the reconciler looks again
    in_review: bool
    unknown_since: datetime | None = None
    last_sent_at: datetime | None = None
    lease_until: datetime | None = None  # a submitted one's sender's lease
    sends: tuple[tuple[datetime, datetime | None], ...] = ()
    lease_ends: tuple[datetime | None, ...] = ()
    #: after a step of the database's clock, the latest a send in flight at the step may
    #: still be sent (``outbox.clock_steps``); None: no step is known
    clock_doubt_until: datetime | None = None


@dataclass(frozen=True)
class VerdictDue:
    """What an uncertain operation waits for, and the latest it is decided by (None: no time
    is promised, staff decide)."""

    waits_for: WaitsFor
    by: datetime | None

    def as_evidence(self) -> dict[str, Any]:
        """The report line's evidence: the reason code and the ISO time (None: no time)."""
        return {
            "waits_for": self.waits_for.value,
            "verdict_by": self.by.isoformat() if self.by is not None else None,
        }


def verdict_due(op: Uncertain, cadence: Cadence) -> VerdictDue:
    """What ``op`` waits for and the latest it is decided by (the module's docstring says
    why the bound holds)."""
    if op.in_review:
        return VerdictDue(WaitsFor.STAFF, None)
    if op.state is State.SUBMITTED:
        # Its worker writes what came back before its lease ends; a worker lost leaves it to
        # the reconciler after the lease, which finds it or records it unknown, due at once.
        lapsed = max(op.lease_until or op.now, op.now) + cadence.late
        as_unknown = Uncertain(
            State.UNKNOWN,
            op.contract,
            op.now,
            op.deadline,
            next_look_at=lapsed + cadence.late,
            in_review=False,
            unknown_since=op.unknown_since or lapsed,
            last_sent_at=op.last_sent_at,
            sends=op.sends,
            lease_ends=op.lease_ends,
            clock_doubt_until=op.clock_doubt_until,
        )
        return VerdictDue(WaitsFor.SEND, verdict_due(as_unknown, cadence).by)
    next_look = max(op.next_look_at, op.now)
    if not (op.contract.queryable and op.contract.idempotent):
        # no lookup, or no replay that could settle it: the next look puts it in review
        return VerdictDue(WaitsFor.REVIEW, _ceil(next_look + cadence.late))
    quiet = quiet_at(
        op.contract,
        sends=op.sends,
        lease_ends=op.lease_ends,
        client_timeout=cadence.client_timeout,
        last_sent_at=op.last_sent_at,
        now=op.now,
    )
    since = op.unknown_since or op.last_sent_at or op.now
    overdue = min(op.deadline, since + cadence.review_after)
    trusted = None
    if op.clock_doubt_until is not None:
        trusted = op.clock_doubt_until + landing_slack(op.contract)
    decisive = max(quiet, overdue, trusted or quiet)
    first_decisive_look = next_look if next_look >= decisive else decisive + MAX_RECHECK
    by = _ceil(first_decisive_look + cadence.late)
    if op.now < quiet:
        return VerdictDue(WaitsFor.QUIESCENCE, by)
    if trusted is not None and op.now < trusted:
        return VerdictDue(WaitsFor.CLOCK_STEP, by)
    return VerdictDue(WaitsFor.LOOKUP, by)


def _ceil(at: datetime) -> datetime:
    """``at`` rounded up to the whole second: every surface shows whole seconds, and a bound
    shown earlier than it is would promise what is not kept."""
    if at.microsecond == 0:
        return at
    return at.replace(microsecond=0) + timedelta(seconds=1)
