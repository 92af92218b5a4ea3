"""The executor: claim, send, record. The one place retries are decided (through the row).

1. claim the hinted operations by a conditional update (lease in database time, fencing
   version bumped); re-check cancel flag, fingerprint and budget; write the attempt row and
   ``submitted``, committed before anything is sent (``workers.claiming``).
2. send each with the stored idempotency key, no transaction open. A batch is sent at once,
   a thread each, and every send is bounded by its lease: it never starts, and never runs,
   past ``min(deadline, lease end - clock margin)`` (database time, measured on the monotonic
   clock: ``outbox.clock``). A worker delayed past its lease therefore sends nothing, and the
   reconciler may trust a "not found" once the lease is over (plus the processing time).
3. write the outcomes as their sends come back, each under its own lease version (a stale
   worker's write is refused and skips that operation only), with the event rows; a not-sent /
   not-executed outcome schedules ``next_attempt_at`` or stops. The first outcomes back are
   written together in one step, and any late one when it comes back
   (``workers.sending``): one slow send never holds up the other outcomes of its
   batch, and a batch whose sends come back together is one write. An outcome the database
   refuses to store is written alone; failing that, the operation goes to ``unknown`` and
   review; an unreachable database is waited for (``outcome_patience``), never a refusal.
An operation found ``submitted`` with an expired lease may have been sent: it is only queried.
Hints larger than ``max_batch`` are worked in consecutive batches, each claimed just before
it is sent. A doorbell claim that came back full rings again (``when_full``) from a thread of
its own while the batch is sent: a slow broker delays no send, and spends no attempt.

Each step (claim and start; record) runs as its database's ``Storage.step`` says: on
PostgreSQL every write of a step is a single statement per batch; the claim step commits
once (claim and start in one transaction), the record step's one statement on an autocommit
connection; on SQLite each step is one transaction. A step that finds its pooled connection
dead runs once more on a fresh one (``outbox.storage.connection.run_twice``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.change import Change
from outbox.clock import DbClock, Monotonic
from outbox.clock_steps import ClockWatch
from outbox.downstream import Gateway
from outbox.errors import SettledError
from outbox.fingerprint import Fingerprinter
from outbox.kinds import Kind, KindRegistry
from outbox.leases import LeaseKeeper
from outbox.observer import NO_OBSERVER, ClaimedBatch, Observer, guarded
from outbox.outage import DatabaseOutage
from outbox.port_shim import as_gateway
from outbox.retry import DEFAULT_MAX_TRIES
from outbox.states import Event, State
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import start_attempts
from outbox.storage.claims import Claimed
from outbox.storage.runs import cancelled_runs
from outbox.storage.transitions import Transition
from workers.claiming import HOLD_SECONDS, Claims, SendClaims
from workers.downstreams import Downstreams
from workers.failpoints import failpoint
from workers.outcomes import Sent
from workers.recovery import RecoversSent
from workers.sending import SendsBatches

__all__ = ["Executor", "Sent"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Executor(SendsBatches, RecoversSent):
    """The service behind the submit task; built once per worker process.

    Its steps live beside it: sending a batch (``workers.sending``), writing the outcomes
    (``workers.outcomes``) and recovery lookups (``workers.recovery``).
    """

    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    fingerprinter: Fingerprinter
    worker: str
    lease_seconds: float = 15.0
    #: due operations claimed beside the hinted ones, sent concurrently
    batch_extra: int = 0
    #: most operations claimed and sent at once (a thread each, so all start together)
    max_batch: int = 32
    #: a send ends this long before its lease does: slack for the downstream's clock
    clock_margin: float = 1.0
    #: an outcome back waits at least this long for the next to be written with it in one
    #: step (the first ones longer: ``_send_and_record``); none waits for the slowest send
    record_linger: float = 0.1
    #: the most tries an operation may record, sent or not (``SETTLED_RETRY_MAX_TRIES``)
    max_tries: int = DEFAULT_MAX_TRIES
    rand: Callable[[], float] = random.random
    monotonic: Monotonic = time.monotonic
    #: this process's watch on the database's clock (shared with its other services)
    clock_watch: ClockWatch = field(default_factory=ClockWatch)
    #: told of each claim, send, record and recovery (``outbox.observer``; its errors are
    #: logged, never change what is sent or written)
    observer: Observer = NO_OBSERVER
    #: the downstream serving each kind: one's answer wakes what waits for it
    #: (``workers.waking``)
    downstreams: Downstreams = field(default_factory=Downstreams)
    #: this process's view of a database outage (shared with its other services): said once
    #: when it starts and once when it ends (``outbox.outage``)
    outage: DatabaseOutage = field(default_factory=DatabaseOutage)
    #: how long outcomes back from the downstream wait for an unreachable database before
    #: they are left to the reconciler (``workers.outcomes``): as long as their leases are
    #: renewed (``outbox.leases.LONGEST_IN_LEASES`` leases; the runtime's)
    outcome_patience: float = 60.0
    _suspect: set[str] = field(default_factory=set, init=False, repr=False)
    _suspect_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _keeper: LeaseKeeper | None = field(default=None, init=False, repr=False)
    _storage: Storage | None = field(default=None, init=False, repr=False)
    _making: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.gateway = as_gateway(self.gateway, stacklevel=3)  # an old-style adapter too

    @property
    def storage(self) -> Storage:
        """The database's Storage (the sessions' engine's; made again if they change)."""
        engine: Engine = self.sessions.kw["bind"]
        if self._storage is None or self._storage.engine is not engine:
            self._storage = storage_for(engine)
        return self._storage

    def _step(self, work: Callable[[Connection], T]) -> T:
        """One step, atomic as the database's Storage makes it (``Storage.step``)."""
        return self.storage.step(work)

    def execute(
        self,
        ids: Sequence[int],
        *,
        when_full: Callable[[], None] | None = None,
        claims: int | None = None,
    ) -> dict[int, State]:
        """Claim, send and record the hinted operations; returns the states written.

        No ids (a doorbell hint, ``outbox.doorbell``): claim up to ``claims`` due operations
        (default ``batch_extra``), and after a claim that took that many (due operations may be
        left) call ``when_full`` in a thread of its own, started at once and waited for before
        returning, so that a slow ring costs the batch's sends nothing.
        """
        unique = list(dict.fromkeys(ids))
        size = max(1, self.max_batch)
        chunks = [unique[i : i + size] for i in range(0, len(unique), size)] or [[]]
        written: dict[int, State] = {}
        for n, chunk in enumerate(chunks):
            wanted = self.batch_extra if chunk or claims is None else claims
            extra = min(wanted, size - len(chunk)) if n == 0 else 0
            written.update(self._execute_batch(chunk, extra, when_full if not chunk else None))
        return written

    def _execute_batch(
        self, ids: Sequence[int], extra: int, when_full: Callable[[], None] | None = None
    ) -> dict[int, State]:
        # Taken before the claim is asked: database time estimated from it runs ahead of the
        # database's, never behind (outbox.clock).
        mono = self.monotonic()
        with guarded(self.observer).claiming(ids) as seen:
            claims = self._claim(ids, extra)
            seen(ClaimedBatch(ids, claims.claimed, [c for c, _ in claims.send], claims.recover))
        self._clock_read(claims, mono)
        full = extra > 0 and len(claims.claimed) + len(claims.written) >= extra
        to_send, to_recover, written = claims.send, claims.recover, claims.written
        held = [c for c, _ in to_send] + to_recover
        # Off the send path: every send is bounded by the claim's lease, which renewal does not
        # extend, so a ring waited for here would spend the batch's time (and its attempts).
        ring = _ring(when_full) if full and when_full is not None else None
        try:
            # Renewed while this worker works on them (a slow outcome write, a lookup); if the
            # worker dies they are free a short lease later (``outbox.leases``).
            with self.keeper.holding(held):
                if claims.blocked:
                    written.update(self._hold(claims.blocked))
                failpoint("after_claim")
                batch = [(c, k, self._clock(c, mono)) for c, k in to_send]
                written.update(self._send_and_record(batch))
                for claimed in to_recover:
                    written.update(self._recover(claimed, self._clock(claimed, mono)))
        finally:
            if ring is not None:
                ring.join()
        failpoint("after_outcome")
        return written

    @property
    def keeper(self) -> LeaseKeeper:
        with self._making:  # one per executor, when batches run in several threads
            if self._keeper is None:
                self._keeper = LeaseKeeper(
                    self.sessions,
                    owner=self.worker,
                    lease_seconds=self.lease_seconds,
                    outage=self.outage,
                )
            return self._keeper

    def _clock(self, claimed: Claimed, mono: float) -> DbClock:
        return DbClock(claimed.now, mono, self.monotonic)

    def _clock_read(self, claims: Claims, before: float) -> None:
        """The claim's reading of the database's clock: a step it shows is logged and recorded
        for the processes that trust a "not found" (this one trusts none)."""
        claimed = claims.claimed
        if not claimed:
            return
        first = claimed[0]
        after = self.monotonic()
        step = self.clock_watch.seen(first.now, before, after, by=self.worker)
        if step is not None:
            self.clock_watch.record_now(self.sessions, step, by=self.worker)

    def _claim(self, ids: Sequence[int], extra: int) -> Claims:
        claims = SendClaims(
            self.storage,
            self.registry,
            self.fingerprinter,
            self.worker,
            self.lease_seconds,
            self.max_tries,
        )
        # One commit for the claim, the stops and the attempts started (a claim lost with its
        # connection is undone, and free again at once).
        return self.storage.step(lambda conn: claims.claim(conn, ids, extra), one_commit=True)

    def resend(self, claimed: Claimed, kind: Kind, clock: DbClock, *, looked: bool) -> State | None:
        """Send an ``unknown`` operation again with its stored key, under the caller's claim
        (the reconciler's, whose decision it is: ``reconciler.decide``), and record what came
        back (``judge_resend``). ``looked``: a lookup came before it (counted).

        The last checks of any send come first (``check_before_send``: the run's cancel flag,
        the fingerprint, the deadline, the attempt budget, the key retention less its margin):
        if one would stop it, nothing is sent and nothing written, and None is returned (the
        operation stays unknown, waiting for its proof). Else the attempt row and
        ``submitted`` are committed before the send, which is bounded by the claim's lease as
        every send is (``send_deadline``), and the outcome written under the same fence."""
        checks = SendClaims(
            self.storage, self.registry, self.fingerprinter, self.worker, self.lease_seconds,
            self.max_tries,
        )  # fmt: skip

        def start(conn: Connection) -> list[Claimed]:
            try:
                fingerprint_ok = checks.fingerprint_ok(claimed, kind)
            except SettledError:
                return []  # this process cannot check it: it does not send it either
            cancelled = claimed.run_id in cancelled_runs(conn, [claimed.run_id])
            if checks.check(claimed, kind, fingerprint_ok, cancelled) is not None:
                return []
            return start_attempts(
                self.storage, conn, [claimed], worker=self.worker, event=Event.RESEND,
                looked=looked,
            )  # fmt: skip

        started = self.storage.step(start, one_commit=True)
        if not started:
            return None
        sent = self._send_one(started[0], kind, clock)
        written = self._record_sent([replace(sent, resent=True)], first=False)
        return written.get(claimed.id, State.SUBMITTED)

    def _hold(self, blocked: list[tuple[Claimed, str]]) -> dict[int, State]:
        """Release operations this worker cannot check, to be looked at again ``HOLD_SECONDS``
        later (by a worker whose configuration has what is missing): an event row says why."""
        held: dict[int, State] = {}
        for claimed, why in blocked:
            held_back = Change.look(
                why,
                recheck_at=claimed.now + timedelta(seconds=HOLD_SECONDS),
                evidence={"held": why, "sent": False},
            )
            look = Transition.of(claimed, held_back)
            try:
                self._write_one(look)
            except SettledError:  # StaleLease: a newer claim holds it
                continue
            held[claimed.id] = claimed.state
        return held

    def _write_one(self, transition: Transition) -> None:
        """One transition, in a step of its own; StaleLease when its fence no longer holds."""
        self._step(lambda conn: self.storage.write_transition(conn, transition, actor=self.worker))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._keeper is not None:
            self._keeper.close()


def _ring(when_full: Callable[[], None]) -> threading.Thread:
    """``when_full`` running in a thread of its own (started here); an error is logged."""

    def ring() -> None:
        try:
            when_full()
        except Exception:
            log.exception("ringing again failed; the sweeper finds what is left due")

    thread = threading.Thread(target=ring, name="settled-ring", daemon=True)
    thread.start()
    return thread
