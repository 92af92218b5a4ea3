"""The retry budget: one owner of retries, as pure functions over values.

A send that provably did not execute (nothing left, or the downstream refused it before
processing) is tried again by time: exponential backoff with full jitter (base 0.2 s, factor 2,
up to the policy's cap of minutes), never less than the floor (no tight loop, whatever the
randomness), never past the deadline. Two budgets bound it besides the deadline: the operation's
``max_attempts``, which counts only the attempts that may have reached the downstream (a request
that never left costs the downstream nothing), and the policy's ``max_tries``, a sanity ceiling
on every try recorded. ``Retry-After`` is honoured only while it fits in what is left, else the
decision is to stop. Randomness is injected so that tests can pin it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

_SECONDS = re.compile(r"[ \t]*([0-9]{1,10})[ \t]*")

#: The longest wait between two tries unless a kind's contract or ``SETTLED_RETRY_CAP_SECONDS``
#: says otherwise: a downstream that refuses connections for minutes is tried every few minutes.
DEFAULT_CAP_SECONDS = 300.0
#: The most tries one operation may record, those that never left included: a sanity ceiling
#: (``SETTLED_RETRY_MAX_TRIES``), far above what an hour's deadline at the default cap takes.
DEFAULT_MAX_TRIES = 1000


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 0.2
    factor: float = 2.0
    cap: float = DEFAULT_CAP_SECONDS
    #: the least wait between two tries, whatever the jitter draws
    floor: float = 0.1
    #: the most tries recorded (every attempt started, sent or not)
    max_tries: int = DEFAULT_MAX_TRIES

    def backoff_ceiling(self, tries: int) -> float:
        """Upper bound of the jittered delay after ``tries`` tries (>= 1)."""
        exponent = max(0, tries - 1)
        return float(max(self.floor, min(self.cap, self.base * self.factor ** min(exponent, 64))))


@dataclass(frozen=True)
class RetryAt:
    """Send again at ``when`` with the same idempotency key."""

    when: datetime


#: Why a retry stops: the operation's deadline; its attempt budget (``max_attempts``, attempts
#: that reached the downstream); a ``Retry-After`` longer than what is left; the ceiling on tries.
STOPS = ("deadline_passed", "attempts_exhausted", "retry_after_past_deadline", "tries_exhausted")


@dataclass(frozen=True)
class Stop:
    """Nothing fits in the budget: stop (reason says which limit, one of ``STOPS``)."""

    reason: str


RetryDecision = RetryAt | Stop


def next_retry(
    *,
    tries: int,
    reached: int,
    max_attempts: int,
    deadline: datetime,
    now: datetime,
    retry_after: float | None = None,
    policy: RetryPolicy = RetryPolicy(),
    rand: Callable[[], float],
) -> RetryDecision:
    """Decide when to try again after ``tries`` tries that did not execute, ``reached`` of
    which may have reached the downstream (only those count against ``max_attempts``)."""
    if reached >= max_attempts:
        return Stop("attempts_exhausted")
    if tries >= policy.max_tries:
        return Stop("tries_exhausted")
    left = (deadline - now).total_seconds()
    if left <= 0:
        return Stop("deadline_passed")
    if retry_after is not None:
        when = now + timedelta(seconds=max(policy.floor, retry_after))
        if retry_after >= left or when >= deadline:
            return Stop("retry_after_past_deadline")
        return RetryAt(when)
    # Full jitter over the window, never below the floor, never reaching the deadline (where
    # nothing may be sent any more).
    window = min(policy.backoff_ceiling(tries), left)
    when = now + timedelta(seconds=policy.floor + rand() * max(0.0, window - policy.floor))
    if window < policy.floor or when >= deadline:
        return Stop("deadline_passed")  # no room for another try before it
    return RetryAt(when)


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
