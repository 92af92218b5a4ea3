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
   (``Executor._send_and_record``): one slow send never holds up the other outcomes of its
   batch, and a batch whose sends come back together is one write. An outcome the database
   refuses to store is written alone; failing that, the operation goes to ``unknown`` and
   review.
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
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from outbox.change import Change
from outbox.clock import DbClock, Deadline, Monotonic
from outbox.clock_steps import ClockWatch
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Gateway,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    as_gateway,
    look_up,
    lookup_deadline,
)
from outbox.errors import SettledError
from outbox.fingerprint import Fingerprinter
from outbox.kinds import Kind, KindRegistry
from outbox.leases import LeaseKeeper
from outbox.retry import DEFAULT_MAX_TRIES
from outbox.states import ConfigFault, Event, State
from outbox.storage import Storage, storage_for
from outbox.storage.claims import Claimed
from outbox.storage.transitions import Finish, Transition
from workers.claiming import HOLD_SECONDS, Claims, SendClaims
from workers.failpoints import failpoint
from workers.verdicts import Budget, judge_recovery, judge_submit

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Sent:
    claimed: Claimed
    kind: Kind
    outcome: SubmitOutcome
    #: database time when the outcome came back (estimated on the monotonic clock)
    at: datetime


@dataclass
class Executor:
    """The service behind the submit task; built once per worker process."""

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
        claims = self._claim(ids, extra)
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
                    self.sessions, owner=self.worker, lease_seconds=self.lease_seconds
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

    def _send_and_record(self, batch: list[tuple[Claimed, Kind, DbClock]]) -> dict[int, State]:
        """Send the batch, a thread each, and write the outcomes as they come back.

        The first answer back is written in one step with those that follow it, each within
        as long as the batch has been out (at least ``record_linger``) of the one before:
        sends that start together to one downstream come back spread over about their own
        length (measured here: 32 to the simulator on a loaded two-core machine came back
        over 0.1 to 1.2 s, up to 0.33 s apart), and a batch written in one step is one
        statement on PostgreSQL. These are written by twice the time the slowest of them
        took, never held for a slow send (30 s where the others took 0.3 s): the late ones
        are written as they come back, with any back within ``record_linger``. A send that
        raised (a bug: a gateway returns values) is left ``submitted`` for the reconciler to
        look up, the others are written, and its error raised after.
        """
        if len(batch) <= 1:
            return self._record_sent([self._send_one(*one) for one in batch], first=True)
        with self._making:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.max_batch), thread_name_prefix="settled-send"
                )
            pool = self._pool
        started = time.monotonic()  # waits on threads, in real time: not the injected clock
        order = {pool.submit(self._send_one, *one): n for n, one in enumerate(batch)}
        pending: set[Future[Sent]] = set(order)
        written: dict[int, State] = {}
        error: BaseException | None = None
        first = True
        while pending:
            back, pending = wait(pending, return_when=FIRST_COMPLETED)
            while pending:  # more, while they keep coming back
                out = time.monotonic() - started if first else 0.0
                more, pending = wait(
                    pending, timeout=max(self.record_linger, out), return_when=FIRST_COMPLETED
                )
                if not more:
                    break
                back |= more
            sent: list[Sent] = []
            for future in sorted(back, key=order.__getitem__):
                if future.exception() is None:
                    sent.append(future.result())
                elif error is None:
                    error = future.exception()
            if sent:
                written.update(self._record_sent(sent, first=first))
                first = False
        if error is not None:
            raise error
        return written

    def _record_sent(self, sent: list[Sent], *, first: bool) -> dict[int, State]:
        if not sent:
            return {}
        if first:
            failpoint("after_send")  # sent (some of the batch at least), nothing recorded
        return self._record(sent)

    def send_deadline(self, claimed: Claimed, clock: DbClock) -> Deadline:
        """When this attempt must be over: the operation's deadline, or its lease's end less
        the clock margin, whichever comes first (database time)."""
        lease_end = claimed.lease_until - timedelta(seconds=self.clock_margin)
        return clock.deadline(min(claimed.deadline, lease_end))

    def _send_one(self, claimed: Claimed, kind: Kind, clock: DbClock) -> Sent:
        deadline = self.send_deadline(claimed, clock)
        outcome: SubmitOutcome
        if deadline.left() <= 0:
            # Delayed past the lease (a pause, a queue): another worker or the reconciler may
            # own the operation now. Provably nothing was sent.
            log.warning("not sent: the lease ended first", extra={"operation_id": claimed.id})
            outcome = NotSent("the lease ended before sending", SendPhase.BEFORE)
        else:
            outcome = self.gateway.submit(DownstreamRequest.of(claimed, kind), deadline=deadline)
        return Sent(claimed, kind, outcome, clock.now())

    def _record(self, batch: list[Sent]) -> dict[int, State]:
        """Write the outcomes of a batch, each under its own lease version.

        A stale lease (a newer claim took the operation over) skips that operation only: its
        fenced UPDATE matched no row and nothing else of it is written; the others are written.
        """
        judged = [(sent, self._judge(sent)) for sent in batch]
        transitions = [Transition.of(sent.claimed, change) for sent, change in judged]
        finishes = [_finish(sent) for sent, _ in judged]
        written: dict[int, State] = {}
        try:
            done = self._step(
                lambda conn: self.storage.write_transitions(
                    conn, transitions, actor=self.worker, finishes=finishes
                )
            )
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise
            # One operation's outcome the database will not take (a value out of range, a
            # constraint) must not cost the others theirs: write them one by one.
            log.error(
                "outcomes of a batch refused by the database; writing them one by one",
                extra={"error": type(exc.orig).__name__},
            )
            done, written = self._record_each(transitions, finishes)
        for sent, change in judged:
            if sent.claimed.id in done and sent.claimed.id not in written:
                assert change.to is not None  # a verdict on a send always moves
                written[sent.claimed.id] = change.to
                log.info(
                    "attempt recorded",
                    extra={
                        "operation_id": sent.claimed.id,
                        "attempt": sent.claimed.attempts,
                        "proof": sent.outcome.proof.value,
                        "state": change.to.value,
                    },
                )
                if change.note == ConfigFault.CREDENTIALS_REFUSED:
                    _log_credentials_refused(sent)
        return written

    def _judge(self, sent: Sent) -> Change:
        claimed = sent.claimed
        return judge_submit(
            sent.outcome,
            budget=Budget(
                claimed.attempts, claimed.reached, claimed.max_attempts, claimed.deadline
            ),
            contract=sent.kind.contract,
            now=sent.at,
            rand=self.rand,
            max_tries=self.max_tries,
        )

    def _record_each(
        self, transitions: Sequence[Transition], finishes: Sequence[Finish]
    ) -> tuple[set[int], dict[int, State]]:
        """Write each outcome alone; one the database refuses becomes ``unknown`` with a
        review item (its effect may have happened: it must not be lost, nor re-sent).
        Returns the ids written, and the states of those written otherwise than judged."""
        done: set[int] = set()
        instead: dict[int, State] = {}

        def alone(transition: Transition, finish: Finish) -> set[int]:
            return self._step(
                lambda conn: self.storage.write_transitions(
                    conn, [transition], actor=self.worker, finishes=[finish]
                )
            )

        for one, finish in zip(transitions, finishes, strict=True):
            claimed = finish.claimed
            try:
                done |= alone(one, finish)
                continue
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise
                error = type(exc.orig).__name__
            log.error(
                "outcome refused by the database; to review",
                extra={"operation_id": claimed.id, "error": error},
            )
            evidence = {"detail": "the database refused the outcome", "error": error}
            lost = Change(
                Event.LOSE, State.UNKNOWN, evidence=evidence, review="outcome_not_recorded"
            )
            fallback = Transition.of(claimed, lost)
            proof = Finish(claimed, finish.proof, finish.status_code, {"error": error})
            try:
                if alone(fallback, proof):
                    done.add(claimed.id)
                    instead[claimed.id] = State.UNKNOWN
            except DBAPIError:
                # Left submitted under an expiring lease: the reconciler will look it up.
                log.exception("could not record the operation", extra={"operation_id": claimed.id})
        return done, instead

    def _recover(self, claimed: Claimed, clock: DbClock) -> dict[int, State]:
        """The worker that sent this died before recording: ask, never re-send.

        The lookup has half a lease from its own start (after the batch's sends), within the
        lease as renewed; one the lease leaves no time for is not asked, and nothing is
        written: the operation stays ``submitted``, and is looked at again once this lease
        lapses (never recorded "unavailable" for a question nobody asked).
        """
        try:
            kind = self.registry.get(claimed.kind)
        except SettledError:
            log.error("cannot look up an unknown kind", extra={"operation_id": claimed.id})
            return {}
        if kind.contract.queryable:
            half = self.lease_seconds / 2
            lease = self.keeper.lease_until(claimed)
            deadline = lookup_deadline(clock, lease, half, least=half)
            if deadline is None:
                log.warning(
                    "recovery lookup not asked: the lease left no time for it",
                    extra={"operation_id": claimed.id},
                )
                return {}
            found = look_up(self.gateway, claimed, kind, deadline=deadline)
            change = judge_recovery(found)
        else:
            change = judge_recovery(None)
        found_out = Transition.of(claimed, change, looked=kind.contract.queryable)
        if not self._step(
            lambda conn: self.storage.write_transitions(conn, [found_out], actor=self.worker)
        ):
            return {}  # refused as stale: a newer claim holds it
        return {claimed.id: found_out.to}

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


def _log_credentials_refused(sent: Sent) -> None:
    """ERROR, naming the operation: the downstream refused our credentials for its tenant."""
    claimed, outcome = sent.claimed, sent.outcome
    log.error(
        "not done: the downstream refused our credentials for this tenant (its API key is "
        "missing or wrong: SETTLED_DOWNSTREAM_API_KEYS or SETTLED_STRIPE_API_KEYS); "
        "rejected, nothing executed",
        extra={
            "operation_id": claimed.id,
            "tenant": claimed.tenant,
            "op_id": claimed.op_id,
            "kind": claimed.kind,
            "stop": ConfigFault.CREDENTIALS_REFUSED.value,
            "status": _status(outcome),
            "error": getattr(outcome, "code", None),
        },
    )


def _finish(sent: Sent) -> Finish:
    outcome = sent.outcome
    return Finish(sent.claimed, outcome.proof.value, _status(outcome), _detail(outcome))


def _status(outcome: SubmitOutcome) -> int | None:
    status = getattr(outcome, "status", None)
    return status if isinstance(status, int) else None


def _detail(outcome: SubmitOutcome) -> dict[str, Any]:
    if isinstance(outcome, Accepted):
        return {"reference": outcome.receipt.reference}
    detail = {
        k: v
        for k, v in vars(outcome).items()
        if k not in ("proof", "receipt") and isinstance(v, str | int | float | type(None))
    }
    if isinstance(outcome, Refused):
        detail["reason"] = outcome.reason.value
    return detail
