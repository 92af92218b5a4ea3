"""One time base for every deadline: the database's clock, measured on the monotonic clock.

Leases, deadlines, quiescence and key retention are all stated in database time. A process
never compares them with its own wall clock (which may run seconds ahead or behind the
database's): it reads the database's time once (a claim returns it) and measures what has
passed since on ``time.monotonic``. The estimate runs *ahead* of the database, never behind,
because the monotonic reading is taken before the database is asked: whatever is measured to
be left is at most what is really left.
"""

from __future__ import annotations

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

    def earlier(self, other: Deadline) -> Deadline:
        """Whichever of the two deadlines comes first."""
        return self if self.expires <= other.expires else other

    @classmethod
    def from_wall(
        cls, at: datetime, wall_now: datetime, monotonic: Monotonic = time.monotonic
    ) -> Deadline:
        """A deadline given on a wall clock whose current reading is ``wall_now``."""
        return cls(at, monotonic() + (at - wall_now).total_seconds(), monotonic)
