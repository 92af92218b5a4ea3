"""One time base for every deadline: the database's clock, measured on the monotonic clock.

Leases, deadlines, quiescence and key retention are all stated in database time. A process
never compares them with its own wall clock (which may run seconds ahead or behind the
database's): it reads the database's time once (a claim returns it) and measures what has
passed since on ``time.monotonic``. The estimate runs *ahead* of the database, never behind,
because the monotonic reading is taken before the database is asked: whatever is measured to
be left is at most what is really left.

All of that holds while the database's clock runs steadily, as a clock slewed by NTP does. A
clock that is *set* (stepped) moves every deadline of the readings taken before it: after a
forward step a lease ends early in database time while its sender still measures it from an
earlier reading. ``StepDetector`` sees a step between two readings, and says until when a
"not found" must not be trusted (``outbox.clock_steps`` watches for steps in a process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

Monotonic = Callable[[], float]


@dataclass(frozen=True)
class DbClock:
    """The database's time, estimated from one reading.

    ``db_at`` is what the database's clock said; ``mono_at`` is the monotonic time taken
    *before* the database was asked, so ``now()`` is never earlier than the database's clock.
    """

    db_at: datetime
    mono_at: float
    monotonic: Monotonic = field(default=time.monotonic, compare=False, repr=False)

    def now(self) -> datetime:
        """The database's time now, rounded up (see the class docstring)."""
        return self.db_at + timedelta(seconds=self.monotonic() - self.mono_at)

    def deadline(self, at: datetime) -> Deadline:
        """``at`` (database time) as a deadline this process can measure."""
        expires = self.mono_at + (at - self.db_at).total_seconds()
        return Deadline(at, expires, self.monotonic)

    def after(self, seconds: float) -> Deadline:
        """The deadline ``seconds`` after the reading."""
        return self.deadline(self.db_at + timedelta(seconds=seconds))


@dataclass(frozen=True)
class Deadline:
    """When an attempt or a lookup must be over.

    ``at`` is in database time (what the downstream is told, as the ``Settled-Deadline``
    header); ``expires`` is the same moment on this process's monotonic clock (what timeouts
    are measured against).
    """

    at: datetime
    expires: float
    monotonic: Monotonic = field(default=time.monotonic, compare=False, repr=False)

    def left(self) -> float:
        """Seconds left (0 when passed)."""
        return max(0.0, self.expires - self.monotonic())

    def capped(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first."""
        now = self.monotonic()
        over = self.expires - now - seconds
        if over <= 0:
            return self
        return Deadline(self.at - timedelta(seconds=over), now + seconds, self.monotonic)

    def time_at(self, mono: float) -> datetime:
        """The time (in the deadline's time base, database time) at monotonic time ``mono``:
        as ``DbClock.now`` reckons it, ahead of the database's clock, never behind."""
        return self.at - timedelta(seconds=self.expires - mono)

    def earlier(self, other: Deadline) -> Deadline:
        """Whichever of the two deadlines comes first."""
        return self if self.expires <= other.expires else other

    @classmethod
    def from_wall(
        cls, at: datetime, wall_now: datetime, monotonic: Monotonic = time.monotonic
    ) -> Deadline:
        """A deadline given on a wall clock whose current reading is ``wall_now``."""
        return cls(at, monotonic() + (at - wall_now).total_seconds(), monotonic)


#: How far the monotonic clock and the database's may drift apart per second without a step
#: (1000 ppm: twice the most the kernel lets NTP correct a clock's frequency by). Readings far
#: apart are allowed that much more than the margin, so an idle process never sees drift as a
#: step.
DRIFT = 0.001


@dataclass(frozen=True)
class Reading:
    """One reading of the database's clock: what it said (``db_at``), and the monotonic clock
    just before it was asked (``before``) and just after the answer came back (``after``;
    None: the same as ``before``). The database read its clock somewhere in between."""

    db_at: datetime
    before: float
    after: float | None = None

    @property
    def ends(self) -> tuple[float, float]:
        """The database's clock less the monotonic clock, at least and at most (seconds)."""
        at = self.db_at.timestamp()
        after = self.before if self.after is None else self.after
        return at - after, at - self.before


@dataclass(frozen=True)
class Step:
    """A step of the database's clock seen between two readings."""

    #: how far the database's clock moved against the monotonic clock: > 0 forward
    seconds: float
    #: the database's time at the reading that showed it (after the step)
    at: datetime
    #: until when (database time) a "not found" must not be trusted because of it
    distrust_until: datetime

    @property
    def direction(self) -> str:
        return "forward" if self.seconds > 0 else "backward"


class StepDetector:
    """Sees steps of the database's clock in successive readings; thread-safe.

    Between two readings the database's clock must advance as the monotonic clock does, within
    ``margin`` seconds (plus ``DRIFT`` per second between them). A reading whose interval
    (``Reading.ends``) is further off than that from the previous one's shows a step: the
    database's clock was set, not slewed. Leases, deadlines and quiescence are in database time
    while each sender measures its bound on its own monotonic clock from a reading taken before
    the step, so a "not found" proves nothing until every send that was in flight at the step
    is over: ``window`` seconds (at least the longest lease) after the step was seen.

    A reading taken before the newest one seen (another thread's, answered later) is ignored.
    """

    def __init__(self, *, margin: float, window: float) -> None:
        self.margin = margin
        self.window = window
        self._last: Reading | None = None
        self._until: datetime | None = None
        self._lock = threading.Lock()

    def observe(self, reading: Reading) -> Step | None:
        """Take in a reading; the step it shows against the previous one, or None."""
        with self._lock:
            last, self._last = self._last, reading
            if last is None:
                return None
            if reading.before < last.before:
                self._last = last  # older than the newest seen: nothing to compare it with
                return None
            lo, hi = reading.ends
            last_lo, last_hi = last.ends
            apart = (reading.before if reading.after is None else reading.after) - last.before
            allowed = self.margin + DRIFT * apart
            if lo - last_hi <= allowed and last_lo - hi <= allowed:
                return None
            seconds = (lo + hi) / 2 - (last_lo + last_hi) / 2
            until = reading.db_at + timedelta(seconds=self.window)
            self._until = until
            return Step(seconds, reading.db_at, until)

    def distrust_until(self) -> datetime | None:
        """Until when (database time) a "not found" must not be trusted after the last step
        this detector saw (None: it saw none)."""
        with self._lock:
            return self._until
