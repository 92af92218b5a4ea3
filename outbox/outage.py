"""Whether the database is away, and one process's outage said in two lines.

``database_away`` tells an unreachable database (a refused or dropped connection, a server
shutting down: SQLAlchemy's ``connection_invalidated``, an ``OperationalError``) from a value
the database refused, which is one operation's own trouble. Every service asks it, so that a
restart or a network blip is never reported as a refused outcome nor put in review.

``DatabaseOutage`` is the process's one view of an outage (shared by its services, as the
clock watch is): the first failure logs ``database unreachable; retrying`` (WARNING) with
what waits at that moment; the others are counted, not logged; the first success after it
logs ``database reachable again after N s`` (WARNING) with what was retried and what was
skipped meanwhile. Retried: writes this process kept, which it writes now that the database
answers (a worker's outcomes; those it gave up waiting for are not counted). Skipped: work
given up until a later pass finds it again (a hint, a sweep, a reconcile pass: the rows are
where they were, and beat's next pass or the sweeper's next hint takes them up).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.exc import DBAPIError, OperationalError

from outbox.clock import Monotonic

log = logging.getLogger(__name__)


def database_away(exc: BaseException) -> bool:
    """The database could not be reached or dropped the connection (as opposed to refusing a
    value, which is this operation's own trouble)."""
    if not isinstance(exc, DBAPIError):
        return False
    return bool(exc.connection_invalidated) or isinstance(exc, OperationalError)


@dataclass
class DatabaseOutage:
    """One process's outage of its database: a line when it starts, one when it ends, counts
    in between. Thread-safe."""

    monotonic: Monotonic = time.monotonic
    _since: float | None = field(default=None, init=False)
    _retried: int = field(default=0, init=False)
    _skipped: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def away(self, exc: BaseException, *, waiting: int = 0, skipped: int = 0) -> bool:
        """Whether ``exc`` says the database is away (``database_away``); if so, count it:
        ``waiting`` writes newly kept to retry (a retry of them counts none), ``skipped``
        pieces of work given up to the next pass. The first of an outage is logged, with what
        waits then; the others are not."""
        if not database_away(exc):
            return False
        with self._lock:
            first = self._since is None
            if first:
                self._since = self.monotonic()
                self._retried = self._skipped = 0
            self._retried += waiting
            self._skipped += skipped
        if first:
            what = [f"{_many(waiting, 'write')} waiting"] if waiting else []
            what += [f"{_many(skipped, 'task')} skipped"] if skipped else []
            log.warning(
                "database unreachable; retrying" + (f" ({', '.join(what)})" if what else ""),
                extra={
                    "waiting": waiting,
                    "skipped": skipped,
                    "error": type(getattr(exc, "orig", None) or exc).__name__,
                },
            )
        return True

    def gave_up(self, writes: int) -> None:
        """``writes`` counted as waiting were given up (left to the reconciler): not retried."""
        with self._lock:
            if self._since is not None:
                self._retried = max(0, self._retried - writes)

    def back(self) -> None:
        """The database answered: ends an outage, with its one line, if one was on."""
        with self._lock:
            since, self._since = self._since, None
            retried, skipped = self._retried, self._skipped
        if since is None:
            return
        seconds = round(self.monotonic() - since, 1)
        log.warning(
            f"database reachable again after {seconds:g} s; {_many(retried, 'write')} retried, "
            f"{_many(skipped, 'task')} skipped meanwhile",
            extra={"outage_seconds": seconds, "retried": retried, "skipped": skipped},
        )


def _many(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
