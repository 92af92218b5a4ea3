"""The one seam between PostgreSQL and SQLite: ``Storage``, chosen by the engine's database.

What differs between the two databases is here and in the two implementations
(``outbox.storage.postgres``, ``outbox.storage.sqlite``), never in a caller:

* writing transitions and their event rows (``write_transitions``, the one writer): on
  PostgreSQL a batch is one static statement (``queries.sql``), atomic by itself; on SQLite a
  few statements per operation, in the caller's transaction;
* the intake INSERT ... ON CONFLICT DO NOTHING (each database's own INSERT construct), one
  statement with its event row: on PostgreSQL a data-modifying CTE writes it, on SQLite a
  trigger (migration 0009);
* the locks a rule that reads before it writes is held under (``serialize``, ``lock_order``):
  on PostgreSQL transaction-level advisory locks, and intake takes an order's lock (shared)
  inside its INSERT, so a rule reading an order waits for an app's transaction still open
  after ``enqueue``; on SQLite one writer at a time already serialises them: ``serialize`` and
  an exclusive ``lock_order`` take the write lock before the rule reads, a shared one is a
  no-op (the intake INSERT that follows takes the write lock, held until the app commits);
* a worker's step: on PostgreSQL an autocommit connection (every write of a step is one
  statement, so no BEGIN and COMMIT round trips), or with ``one_commit`` one transaction
  (the claim step: the claim and the start of its sends, one commit); on SQLite one
  transaction;
* taking the write lock: PostgreSQL locks rows as statements touch them, and a transaction
  that read before it writes just writes; SQLite has one write lock, and a transaction that
  read first cannot take it once another connection has committed (SQLITE_BUSY_SNAPSHOT,
  "database is locked" at once, whatever the busy timeout). So on an engine from
  ``outbox.db.make_engine`` a transaction begun explicitly (``sessions.begin()``, a step's
  ``engine.begin()``) is ``BEGIN IMMEDIATE``: it waits for the lock (the busy timeout) where
  it begins, and what it read is still true when it writes. A session used without
  ``begin()`` reads, deferred, and never waits (``outbox.db.SQLITE_BEGIN``). Whatever writes
  begins explicitly;
* replication: PostgreSQL's standbys and how its commits wait for them
  (``outbox.storage.replication``); SQLite has none.

Callers get theirs from ``outbox.storage.storage_for(engine)`` (and may keep it) and never
look at the dialect.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from outbox.errors import StaleLease
from outbox.storage.connection import Bind, connection_of
from outbox.storage.replication import Replication
from outbox.storage.transitions import Finish, Note, Transition, write_notes

log = logging.getLogger(__name__)

T = TypeVar("T")


class Storage(ABC):
    """What differs per database, for one engine (``outbox.storage.storage_for``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- transitions: the one writer ----------------------------------------------------

    def write_transitions(
        self,
        bind: Bind,
        changes: Sequence[Transition | Note],
        *,
        actor: str,
        finishes: Sequence[Finish] = (),
    ) -> set[int]:
        """Write transitions, each fenced, with their event rows; and notes (event rows
        that change nothing). The one writer of event rows and of fenced state changes.

        ``finishes`` complete the current attempt of operations transitioned (one at most
        each). Returns the ids of the transitions written. One whose fence no longer holds
        (a newer claim took the operation over; a state moved on) is refused and skipped,
        with nothing of it written (nor its Finish); the others are written.
        """
        transitions = [c for c in changes if isinstance(c, Transition)]
        notes = [c for c in changes if isinstance(c, Note)]
        by_id = {f.claimed.id: f for f in finishes}
        if len(by_id) != len(finishes) or not by_id.keys() <= {t.id for t in transitions}:
            raise ValueError("one Finish per transitioned operation at most")
        conn = connection_of(bind)
        written: set[int] = set()
        if transitions:
            written = self._write(conn, transitions, actor=actor, finishes=by_id)
        for t in transitions:
            if t.id not in written and t.lease_version is not None:
                log.warning(
                    "stale write refused",
                    extra={"operation_id": t.id, "lease_version": t.lease_version},
                )
        if notes:
            write_notes(conn, notes, actor=actor)
        return written

    def write_transition(self, bind: Bind, transition: Transition, *, actor: str) -> None:
        """Write one transition; StaleLease, writing nothing, when its fence no longer holds."""
        if not self.write_transitions(bind, [transition], actor=actor):
            raise StaleLease(operation_id=transition.id, lease_version=transition.lease_version)

    @abstractmethod
    def _write(
        self,
        conn: Connection,
        transitions: Sequence[Transition],
        *,
        actor: str,
        finishes: Mapping[int, Finish],
    ) -> set[int]:
        """Write ``transitions`` (their rows, events, review items, attempts); the ids written."""

    # -- intake -------------------------------------------------------------------------

    def create_operation(
        self,
        session: Session,
        values: Mapping[str, Any],
        *,
        default_deadline_seconds: float,
        order_lock: str | None = None,
    ) -> Mapping[str, Any] | None:
        """Insert a planned operation, with its ``created`` event row, in one statement; the
        new row's ``INTAKE_RETURNS`` (``outbox.storage.operations``), or None (nothing
        written) when ``(tenant, op_id)`` already exists. Nothing is loaded into the session.

        ``values["deadline"]`` None: the default one. ``order_lock``: the order's lock
        (``lock_order``), taken shared by the same statement before the row is written and
        held until the transaction ends. The event's evidence names the correlation id."""
        params = {
            **values,
            "default_deadline_seconds": default_deadline_seconds,
            "order_lock": order_lock,
        }
        return self._insert_operation(session, params)

    @abstractmethod
    def _insert_operation(
        self, session: Session, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """INSERT ... ON CONFLICT (tenant, op_id) DO NOTHING RETURNING the new row, its event
        row written by the same statement."""

    @abstractmethod
    def serialize(self, session: Session, key: str) -> None:
        """Hold, until ``session``'s transaction ends, a lock that every other transaction
        asking for the same ``key`` waits for: a read-then-insert under it (is this request a
        repeat? if not, add it) cannot run twice at once."""

    @abstractmethod
    def lock_order(self, session: Session, key: str, *, shared: bool = False) -> None:
        """Hold, until ``session``'s transaction ends, the lock of an order (``key``:
        ``outbox.intake.order_lock``). Every intake on the order takes it shared, so a rule
        that reads the order under it exclusively (the agents' policy, a proposal's repeat
        check) waits for every transaction still open that wrote on the order, and reads
        what it wrote once committed.

        The one lock order: an order's lock, then an original's compensation lock
        (``serialize``), then rows (an operation's row, then its review item). Intakes never
        wait for each other on an order's lock (shared); distinct orders may share a lock
        (PostgreSQL stripes them), which costs a wait, never a wrong answer."""

    # -- a worker's step ----------------------------------------------------------------

    @abstractmethod
    def replication(self, bind: Bind) -> Replication | None:
        """The server's replication as ``bind``'s session sees it (None: the database has
        none)."""

    @abstractmethod
    def step(self, work: Callable[[Connection], T], *, one_commit: bool = False) -> T:
        """Run ``work``, a step whose writes must be atomic, once more if its pooled
        connection turned out to be dead (``outbox.storage.connection.run_twice``).

        ``one_commit``: the step's statements commit together, once (a claim and the start of
        its sends: one commit instead of one per statement; a claim lost with its connection
        is undone, not left leased).
        """
