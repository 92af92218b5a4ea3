"""The retry budget: one owner of retries, as pure functions over values.

Exponential backoff with full jitter (base 0.2 s, factor 2, capped), never past the deadline;
``Retry-After`` is honoured only while it fits in what is left, else the decision is to stop.
Randomness is injected so that tests can pin it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

_SECONDS = re.compile(r"[ \t]*([0-9]{1,10})[ \t]*")


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 0.2
    factor: float = 2.0
    cap: float = 30.0

    def backoff_ceiling(self, attempts_made: int) -> float:
        """Upper bound of the jittered delay after ``attempts_made`` attempts (>= 1)."""
        exponent = max(0, attempts_made - 1)
        return float(min(self.cap, self.base * self.factor ** min(exponent, 64)))


@dataclass(frozen=True)
class RetryAt:
    """Send again at ``when`` with the same idempotency key."""

    when: datetime


@dataclass(frozen=True)
class Stop:
    """Nothing fits in the budget: stop (reason says which limit)."""

    reason: str  # "attempts_exhausted" | "deadline_passed" | "retry_after_past_deadline"


RetryDecision = RetryAt | Stop


def next_retry(
    *,
    attempts_made: int,
    max_attempts: int,
    deadline: datetime,
    now: datetime,
    retry_after: float | None = None,
    policy: RetryPolicy = RetryPolicy(),
    rand: Callable[[], float],
) -> RetryDecision:
    """Decide when to retry after ``attempts_made`` provably-not-executed attempts."""
    if attempts_made >= max_attempts:
        return Stop("attempts_exhausted")
    left = (deadline - now).total_seconds()
    if left <= 0:
        return Stop("deadline_passed")
    if retry_after is not None:
        if retry_after >= left:
            return Stop("retry_after_past_deadline")
        delay = retry_after
    else:
        # Full jitter over the window that is left, so a retry never lands past the deadline.
        delay = rand() * min(policy.backoff_ceiling(attempts_made), left)
    return RetryAt(now + timedelta(seconds=delay))


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date); None if garbage.

    A date in the past gives 0.
    """
    if value is None:
        return None
    m = _SECONDS.fullmatch(value)
    if m:
        return float(int(m.group(1)))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:  # pragma: no cover - older Pythons returned None
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def remaining(deadline: datetime, now: datetime) -> float:
    """Seconds left before ``deadline`` (0 when passed)."""
    return max(0.0, (deadline - now).total_seconds())
