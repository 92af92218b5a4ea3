"""Short leases, kept alive while their holder works on them.

A claim's lease is short (``SETTLED_LEASE_SECONDS``, 15 s by default): when its holder dies
(a SIGKILL, an out-of-memory kill, a lost machine), its operations are free again seconds
later, and the sweeper or the reconciler takes them over. While the holder is alive and still
working on an operation (an outcome write held up by a slow database, a lookup, a
reconciler's chunk), a ``LeaseKeeper`` renews its lease every third of a lease from a thread
of its own, so a live worker is not overtaken.

What renewal does not change (the fencing of ``outbox.storage.claims``):

* every write still names the claim's lease version: renewing never bumps it;
* a send is still bounded by the lease it was claimed with (``attempts.not_after``), so a
  "not found" after that bound (plus the processing time) still proves nothing was sent;
* an expired lease is never revived: once it lapsed it may already be another's;
* a process stopped or frozen renews nothing (the thread stops with it), and renewal ends on
  its own ``longest`` seconds after the claim: a thread stuck forever holds nothing forever.

Its holder asks ``lease_until`` how long a lease is held now (the claim's end, or the last
renewal's): work that must be over while the lease is held, such as each lookup of a
reconciler's chunk, is bounded by it, never by the claim's first lease alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import Monotonic
from outbox.outage import DatabaseOutage
from outbox.storage.claims import Claimed, renew_leases

log = logging.getLogger(__name__)

#: Renewal ends this many leases after the claim (60 s at the default lease).
LONGEST_IN_LEASES = 4

#: How the keeper's thread waits between rounds: ``wait(stop, seconds)`` returns True once
#: ``stop`` is set, False after ``seconds`` (``threading.Event.wait``); injectable for tests.
Wait = Callable[[threading.Event, float], bool]


class LeaseKeeper:
    """Renews the leases of the operations one holder (``owner``) is working on."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        owner: str,
        lease_seconds: float,
        longest: float | None = None,
        monotonic: Monotonic = time.monotonic,
        wait: Wait = threading.Event.wait,
        outage: DatabaseOutage | None = None,
    ) -> None:
        self.sessions = sessions
        #: the process's view of a database outage: a renewal it fails is counted there, not
        #: logged each round
        self.outage = outage
        self.owner = owner
        self.lease_seconds = lease_seconds
        #: how often the thread renews: three chances before a lease runs out
        self.every = lease_seconds / 3
        self.longest = LONGEST_IN_LEASES * lease_seconds if longest is None else longest
        self.monotonic = monotonic
        self._wait = wait
        #: operation id -> (lease version, monotonic time of the claim)
        self._held: dict[int, tuple[int, float]] = {}
        #: (operation id, lease version) -> the lease's end as last renewed (database time);
        #: None: the database refused to renew it (it lapsed, or another holds it now)
        self._renewed: dict[tuple[int, int], datetime | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    @contextmanager
    def holding(self, claims: Iterable[Claimed]) -> Iterator[None]:
        """Keep these claims' leases alive until the block ends."""
        held = [(c.id, c.lease_version) for c in claims]
        if not held:
            yield
            return
        since = self.monotonic()
        with self._lock:
            for op_id, version in held:
                self._held[op_id] = (version, since)
            self._start()
        try:
            yield
        finally:
            with self._lock:
                for op_id, version in held:
                    self._renewed.pop((op_id, version), None)
                    if self._held.get(op_id, (None, 0.0))[0] == version:
                        del self._held[op_id]

    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def lease_until(self, claimed: Claimed) -> datetime | None:
        """When ``claimed``'s lease ends as held now (database time): the claim's own end, or
        its last renewal's; None once the database refused to renew it (it lapsed, or another
        holds it now). A lease no longer renewed (past ``longest``) keeps its last end."""
        with self._lock:
            return self._renewed.get((claimed.id, claimed.lease_version), claimed.lease_until)

    def renew_now(self) -> set[int]:
        """One round: renew what is held and still young enough; returns the ids renewed.

        A lease the database would not renew (expired, or taken over) is dropped: its holder
        learns it at its next fenced write, which is refused.
        """
        now = self.monotonic()
        with self._lock:
            due = [(i, v) for i, (v, since) in self._held.items() if now - since < self.longest]
            for op_id in [i for i, (_, since) in self._held.items() if now - since >= self.longest]:
                del self._held[op_id]
        if not due:
            return set()
        try:
            with self.sessions.begin() as session:
                renewed = renew_leases(
                    session, due, owner=self.owner, lease_seconds=self.lease_seconds
                )
        except SQLAlchemyError as exc:
            # The next round tries again; if the database stays away, the leases lapse and
            # others take over, as they would from a dead worker.
            if self.outage is None or not self.outage.away(exc):
                log.warning("could not renew leases", extra={"error": type(exc).__name__})
            return set()
        lost = {(i, v) for i, v in due if i not in renewed}
        with self._lock:
            for op_id, version in due:
                if self._held.get(op_id, (None, 0.0))[0] != version:
                    continue  # released meanwhile
                if (op_id, version) in lost:
                    del self._held[op_id]
                    self._renewed[(op_id, version)] = None
                else:
                    self._renewed[(op_id, version)] = renewed[op_id]
        if lost:
            log.info("lease not renewed", extra={"operations": len(lost)})
        return set(renewed)

    def close(self) -> None:
        """Stop the renewing thread, waiting up to 5 s for a round under way (a renewal in the
        database) to end; a round stuck longer is left to its daemon thread. Idempotent; a
        later ``holding`` starts a thread again."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _start(self) -> None:
        """Start the renewing thread once per process (a forked child starts its own)."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="settled-lease-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stop = self._stop
        while not self._wait(stop, self.every):
            try:
                self.renew_now()
            except Exception:  # the keeper must outlive any one round
                log.exception("lease renewal failed")
