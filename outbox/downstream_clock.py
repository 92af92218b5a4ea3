"""The downstream's clock, measured against the database's: how far behind it may be.

A deadline fence (``Settled-Deadline``) is enforced by the downstream's own clock, while every
bound Settled reckons is in database time (``outbox.clock``). A downstream whose clock is
``L`` seconds *behind* the database's accepts a request until database time ``D + L``; the
sender set ``D`` at most its lease's end less the clock margin, so the fence holds by the
lease's end only while ``L`` is within the margin. A step of either clock breaks that for every
later send, and nothing on the database's side sees it. So the downstream's time is measured,
not assumed: every answer of the wire protocol says it (``outbox.wire.server_time``), and this
module bounds the lag from one round trip.

The downstream wrote its time somewhere between the request's start and the answer's arrival;
``db_after`` is this process's estimate of the database's time at the arrival, which runs
ahead of the database, never behind (``outbox.clock.DbClock``). The true downstream time lies
in ``[said, said + resolution)``. So the lag is at most ``db_after - said``: an upper bound,
what the fence uses (``Lag.bound``). How far it is certainly behind subtracts the round trip
and the resolution (``Lag.certain``): what starts an episode that is logged, counted and
alerted, so that a whole-second ``Date`` never raises an alarm by its rounding alone.

The sender of a fenced kind also tells the downstream a deadline earlier by the newest lag it
measured (``corrected_deadline``), so the fence cuts at the database time's deadline; never
later, and the reconciler allows for the lag all the same: the correction narrows the window,
it is not relied on.

Only *behind* matters to the fence: a downstream ahead refuses late requests earlier. Pure: no
database, network or clock in here.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta

#: Samples kept per downstream (the newest); the fence reads the worst of those still recent.
KEPT = 256
#: An episode's worst lag is recorded (for other processes) in steps of this many seconds,
#: rounded up: a lag creeping by milliseconds is not a row per answer.
RECORD_STEP = 0.1
#: The most a ``Settled-Deadline`` is moved earlier (seconds): a clock a day behind is broken,
#: not slow; a header a day early is refused by any fence, and no time said (a ``Date`` of the
#: year 1) moves it out of the calendar.
MAX_CORRECTION = 86400.0


@dataclass(frozen=True)
class Lag:
    """How far one answer shows the downstream's clock behind the database's (seconds; < 0:
    ahead), measured at database time ``at``."""

    #: at most this far behind: what the fence must allow for
    bound: float
    #: at least this far behind (the bound less the round trip and the time's resolution)
    certain: float
    #: the database's time (estimated) when the answer came back
    at: datetime


def lag_of(said: datetime, resolution: float, *, db_before: datetime, db_after: datetime) -> Lag:
    """The lag one answer shows: the downstream said ``said`` (true time within
    ``[said, said + resolution)``) while the database's time went from ``db_before`` to
    ``db_after`` (this process's estimates, at the request's start and the answer's arrival)."""
    if resolution < 0:
        raise ValueError("resolution must not be negative")
    if db_after < db_before:
        raise ValueError("the answer cannot arrive before its request started")
    bound = (db_after - said).total_seconds()
    trip = (db_after - db_before).total_seconds()
    return Lag(bound, bound - trip - resolution, db_after)


def corrected_deadline(deadline: datetime, lag: float | None) -> datetime:
    """The ``Settled-Deadline`` to tell a downstream measured ``lag`` seconds behind: its fence,
    read by its own clock, then cuts at ``deadline`` in database time (``lag`` is an upper
    bound: it may cut a little earlier, never later). Never later than ``deadline``: a
    downstream ahead, or not measured, is told ``deadline`` as it is. A correction only makes
    the fence hold sooner; the reconciler allows for the lag all the same (``fence_excess``),
    as it does for a process that corrected nothing."""
    if lag is None or not lag > 0:  # NaN included: no correction
        return deadline
    return deadline - timedelta(seconds=min(lag, MAX_CORRECTION))


def fence_excess(lag: float | None, margin: float) -> timedelta:
    """How much later than its lease's end a fenced request may land: the lag beyond the clock
    margin (the margin is what the header's deadline already leaves), 0 within it or unknown."""
    if lag is None:
        return timedelta(0)
    return timedelta(seconds=max(0.0, lag - margin))


@dataclass(frozen=True)
class Episode:
    """A change of one downstream's lag beyond the clock margin, to log and record."""

    downstream: str
    #: the worst lag bound of the episode so far, rounded up to ``RECORD_STEP``
    lag: float
    #: True: the lag just went beyond the margin (counted and alerted); False: it grew
    begins: bool
    at: datetime


class DownstreamClocks:
    """One process's measurements of its downstreams' clocks; thread-safe.

    ``observe`` takes one answer's lag and says when an episode beyond ``margin`` begins (its
    certain lag beyond the margin) or its worst bound grows a step (both recorded for other
    processes); ``ended`` says when a downstream in an episode came back within the margin.
    ``worst`` is what the fence allows for: the largest bound measured since a time.
    """

    def __init__(self, *, margin: float) -> None:
        self.margin = margin
        self._samples: dict[str, deque[Lag]] = {}
        self._recorded: dict[str, float] = {}  # downstreams in an episode: its recorded worst
        self._lock = threading.Lock()

    def observe(self, downstream: str, lag: Lag) -> Episode | None:
        """Take in one answer's lag; the episode change to record, or None."""
        with self._lock:
            self._samples.setdefault(downstream, deque(maxlen=KEPT)).append(lag)
            recorded = self._recorded.get(downstream)
            rounded = math.ceil(round(lag.bound / RECORD_STEP, 6)) * RECORD_STEP
            if recorded is None:
                if lag.certain <= self.margin:
                    return None
                self._recorded[downstream] = rounded
                return Episode(downstream, rounded, True, lag.at)
            if lag.bound <= self.margin:
                del self._recorded[downstream]  # back within the margin: the episode is over
                return None
            if rounded > recorded:
                self._recorded[downstream] = rounded
                return Episode(downstream, rounded, False, lag.at)
            return None

    def beyond(self, downstream: str) -> bool:
        """Whether ``downstream`` is in an episode (its lag beyond the margin)."""
        with self._lock:
            return downstream in self._recorded

    def latest(self, downstream: str) -> float | None:
        """The lag bound of ``downstream``'s newest answer (None: none said its time): what a
        send's ``Settled-Deadline`` is corrected by (``corrected_deadline``). The newest, not
        the worst: a clock set right is followed at once, and a correction too large costs a
        refusal (``408``, nothing done), whose answer measures the lag again."""
        with self._lock:
            samples = self._samples.get(downstream)
            return samples[-1].bound if samples else None

    def worst(self, downstream: str, *, since: datetime) -> float | None:
        """The largest lag bound measured for ``downstream`` at or after ``since`` (None: no
        answer said its time)."""
        with self._lock:
            bounds = [s.bound for s in self._samples.get(downstream, ()) if s.at >= since]
        return max(bounds) if bounds else None
