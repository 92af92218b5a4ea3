"""When a "not found" becomes proof that nothing ran: the quiescence rule, as pure arithmetic.

The reconciler's decision (``reconciler.decide.Situation.quiet_at``) and the answers that say
when an uncertain operation will be decided (run reports, the status API, the console, the
MCP tools) read these same numbers. No database, clock or network in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from outbox.kinds import DownstreamContract


def landing_slack(contract: DownstreamContract) -> timedelta:
    """How long after its sender is done a request may still land and become visible: the
    processing time, and the declared delay bound where no fence stops it."""
    if contract.enforces_deadline:
        return contract.processing_time
    return contract.max_request_delay + contract.processing_time


def quiet_at(
    contract: DownstreamContract,
    *,
    sends: Sequence[tuple[datetime, datetime | None]],
    lease_ends: Sequence[datetime | None] = (),
    client_timeout: timedelta,
    last_sent_at: datetime | None = None,
    now: datetime,
    lag_excess: timedelta = timedelta(0),
) -> datetime:
    """When no request of any attempt can still land, and whatever landed is visible.

    ``sends`` is, per attempt, its start and the latest it may have been on the wire (its
    outcome written, else its lease's end); ``lease_ends`` per attempt its lease's end. Each
    fenced attempt counts from its lease's end (a proxy may hold a request its client gave up
    on, and the fence stops it there); an unfenced one from the end its sender knew, plus the
    delay bound (``landing_slack``). An attempt with neither bound (written before 0.2) counts
    from its start plus the client timeout; no attempt at all from ``last_sent_at`` (else
    ``now``) plus the client timeout.

    ``lag_excess`` is how far the downstream's clock was measured behind the database's beyond
    the clock margin (``outbox.downstream_clock.fence_excess``): a fence enforced by that clock
    holds that much later than the lease's end, so every fenced attempt counts from then."""
    fenced = contract.enforces_deadline
    if sends:
        ends = tuple(lease_ends) or (None,) * len(sends)
        last = max(
            (lease_end if fenced else None) or end or start + client_timeout
            for (start, end), lease_end in zip(sends, ends, strict=True)
        )
    else:
        last = (last_sent_at or now) + client_timeout
    if fenced:
        last += max(lag_excess, timedelta(0))
    return last + landing_slack(contract)
