"""The executor: claim, send, record. The one place retries are decided (through the row).

1. claim the hinted operations by a conditional update (lease in database time, fencing
   version bumped); re-check cancel flag, fingerprint and budget; write the attempt row and
   ``submitted``, committed before anything is sent.
2. send each with the stored idempotency key, no transaction open. A batch is sent at once,
   a thread each, and every send is bounded by its lease: it never starts, and never runs,
   past ``min(deadline, lease end - clock margin)`` (database time, measured on the monotonic
   clock: ``outbox.clock``). A worker delayed past its lease therefore sends nothing, and the
   reconciler may trust a "not found" once the lease is over (plus the processing time).
3. write the outcomes of the batch, each under its own lease version (a stale worker's write
   is refused and skips that operation only), with the event rows; a not-sent / not-executed
   outcome schedules ``next_attempt_at`` or stops. An outcome the database refuses to store
   is written alone; failing that, the operation goes to ``unknown`` and review.
An operation found ``submitted`` with an expired lease may have been sent: it is only queried.
Hints larger than ``max_batch`` are worked in consecutive batches, each claimed just before
it is sent.

On PostgreSQL every write of a step is a single statement per batch, atomic by itself (the
UPDATE fenced row by row, with the event, attempt and review rows of the rows it updated), so
the steps run on an autocommit connection: no BEGIN and COMMIT round trips. Elsewhere (SQLite)
each step is one transaction.

The engine has no pre-ping (it costs a round trip and a commit per checkout): a step that
finds its pooled connection dead runs once more on a fresh one (``in_transaction``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from outbox import store
from outbox.clock import DbClock, Deadline, Monotonic
from outbox.downstream import (
    Accepted,
    Gateway,
    NotSent,
    Refused,
    SubmitOutcome,
    look_up,
    lookup_deadline,
)
from outbox.errors import InvalidInput, SettledError
from outbox.fingerprint import Fingerprinter
from outbox.kinds import Kind, KindRegistry
from outbox.leases import LeaseKeeper
from outbox.states import Event, State
from workers.failpoints import failpoint
from workers.verdicts import Budget, Verdict, check_before_send, judge_recovery, judge_submit

log = logging.getLogger(__name__)

T = TypeVar("T")

#: An operation this worker cannot check (its kind or fingerprint key version is not configured
#: here) is looked at again this much later: a rolling deploy has time to bring a worker that can.
HOLD_SECONDS = 60.0


def in_transaction(sessions: sessionmaker[Session], work: Callable[[Session], T]) -> T:
    """Run ``work`` in one transaction; once more if the connection turned out to be dead.

    Without pre-ping, a connection that died in the pool (PostgreSQL restarted) fails on its
    first statement and SQLAlchemy invalidates the pool; the second run gets a fresh
    connection. Only for work whose writes are all conditional and fenced: if the lost
    connection did commit, running it again changes nothing (a claim finds the lease taken, an
    outcome finds the state moved on and is refused as stale).
    """
    return _twice(lambda: _in_session(sessions, work))


def _in_session(sessions: sessionmaker[Session], work: Callable[[Session], T]) -> T:
    with sessions.begin() as session:
        return work(session)


def _on_connection(engine: Engine, work: Callable[[Connection], T]) -> T:
    with engine.connect() as conn:
        return work(conn)


def _twice(run: Callable[[], T]) -> T:
    try:
        return run()
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.warning("database connection lost; running the transaction again")
    return run()


@dataclass(frozen=True)
class Sent:
    claimed: store.Claimed
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
    rand: Callable[[], float] = random.random
    monotonic: Monotonic = time.monotonic
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _keeper: LeaseKeeper | None = field(default=None, init=False, repr=False)
    #: PostgreSQL: the sessions' engine, and the same on autocommit connections
    _autocommit: tuple[Engine, Engine] | None = field(default=None, init=False, repr=False)

    def _step(self, work: Callable[[Connection], T]) -> T:
        """One step: on an autocommit connection on PostgreSQL, in a transaction elsewhere;
        run once more if its pooled connection turned out to be dead (see ``in_transaction``)."""
        engine = self.sessions.kw.get("bind")
        if isinstance(engine, Engine) and engine.dialect.name == "postgresql":
            if self._autocommit is None or self._autocommit[0] is not engine:
                self._autocommit = (engine, engine.execution_options(isolation_level="AUTOCOMMIT"))
            autocommit = self._autocommit[1]
            return _twice(lambda: _on_connection(autocommit, work))
        return in_transaction(self.sessions, lambda session: work(session.connection()))

    def execute(self, ids: Sequence[int]) -> dict[int, State]:
        """Claim, send and record the hinted operations; returns the states written."""
        unique = list(dict.fromkeys(ids))
        size = max(1, self.max_batch)
        chunks = [unique[i : i + size] for i in range(0, len(unique), size)] or [[]]
        written: dict[int, State] = {}
        for n, chunk in enumerate(chunks):
            extra = min(self.batch_extra, size - len(chunk)) if n == 0 else 0
            written.update(self._execute_batch(chunk, extra))
        return written

    def _execute_batch(self, ids: Sequence[int], extra: int) -> dict[int, State]:
        # Taken before the claim is asked: database time estimated from it runs ahead of the
        # database's, never behind (outbox.clock).
        mono = self.monotonic()
        to_send, to_recover, blocked, written = self._claim(ids, extra)
        held = [c for c, _ in to_send] + to_recover
        # Renewed while this worker works on them (a slow outcome write, a lookup); if the
        # worker dies they are free a short lease later (``outbox.leases``).
        with self.keeper.holding(held):
            if blocked:
                written.update(self._hold(blocked))
            failpoint("after_claim")
            sent = self._send([(c, k, self._clock(c, mono)) for c, k in to_send])
            if sent:
                failpoint("after_send")
                written.update(self._record(sent))
            for claimed in to_recover:
                written.update(self._recover(claimed, self._clock(claimed, mono)))
        failpoint("after_outcome")
        return written

    @property
    def keeper(self) -> LeaseKeeper:
        if self._keeper is None:
            self._keeper = LeaseKeeper(
                self.sessions, owner=self.worker, lease_seconds=self.lease_seconds
            )
        return self._keeper

    def _clock(self, claimed: store.Claimed, mono: float) -> DbClock:
        return DbClock(claimed.now, mono, self.monotonic)

    def _claim(
        self, ids: Sequence[int], extra: int
    ) -> tuple[
        list[tuple[store.Claimed, Kind]],
        list[store.Claimed],
        list[tuple[store.Claimed, str]],
        dict[int, State],
    ]:
        return self._step(lambda conn: self._claim_in(conn, ids, extra))

    def _claim_in(
        self, conn: Connection, ids: Sequence[int], extra: int
    ) -> tuple[
        list[tuple[store.Claimed, Kind]],
        list[store.Claimed],
        list[tuple[store.Claimed, str]],
        dict[int, State],
    ]:
        to_recover: list[store.Claimed] = []
        stops: list[tuple[store.Move, str]] = []
        #: claimed operations this worker cannot judge (its configuration lacks their kind or
        #: fingerprint key): not sent, held for later; the rest of the batch goes on
        blocked: list[tuple[store.Claimed, str]] = []
        claims = store.claim_for_send(
            conn,
            worker=self.worker,
            lease_seconds=self.lease_seconds,
            ids=ids,
            extra=extra,
        )
        cancelled = store.cancelled_runs(conn, (c.run_id for c in claims))
        fresh: list[tuple[store.Claimed, Kind]] = []
        for claimed in claims:
            if claimed.state is State.SUBMITTED:
                to_recover.append(claimed)
                continue
            try:
                kind = self.registry.get(claimed.kind)
                fingerprint_ok = self._fingerprint_ok(claimed, kind)
            except SettledError as exc:
                log.error(
                    "not sent: this worker cannot check the operation",
                    extra={"operation_id": claimed.id, "error": exc.code},
                )
                blocked.append((claimed, exc.code))
                continue
            check = check_before_send(
                now=claimed.now,
                deadline=claimed.deadline,
                attempts=claimed.attempts,
                max_attempts=claimed.max_attempts,
                reached_downstream=(
                    0 if kind.contract.idempotent else store.reached_downstream(conn, claimed.id)
                ),
                first_sent_at=claimed.first_sent_at,
                contract=kind.contract,
                run_cancelled=claimed.run_id in cancelled,
                fingerprint_ok=fingerprint_ok,
            )
            if check is not None:
                stop = store.Move(
                    claimed,
                    check.event,
                    check.to,
                    reason=check.reason,
                    evidence={"stop": check.why, "sent": False},
                )
                stops.append((stop, check.why))
                continue
            fresh.append((claimed, kind))
        stopped = store.record(conn, [m for m, _ in stops], actor=self.worker)
        written: dict[int, State] = {}
        for stop, why in stops:
            if stop.claimed.id in stopped:
                written[stop.claimed.id] = stop.to
                log.info("not sent", extra={"operation_id": stop.claimed.id, "stop": why})
        kinds = {c.id: k for c, k in fresh}
        started = store.start_attempts(conn, [c for c, _ in fresh], worker=self.worker)
        return [(c, kinds[c.id]) for c in started], to_recover, blocked, written

    def _fingerprint_ok(self, claimed: store.Claimed, kind: Kind) -> bool:
        """Whether the stored params still match the stored fingerprint. Raises SettledError
        when the fingerprint's key version is not configured here (nothing can be checked)."""
        try:
            intent = kind.parse(claimed.params)
        except InvalidInput:
            return False
        return self.fingerprinter.matches(
            kind.name, intent, claimed.fingerprint_key_version, claimed.fingerprint
        )

    def _hold(self, blocked: list[tuple[store.Claimed, str]]) -> dict[int, State]:
        """Release operations this worker cannot check, to be looked at again ``HOLD_SECONDS``
        later (by a worker whose configuration has what is missing): an event row says why."""
        held: dict[int, State] = {}
        for claimed, why in blocked:

            def hold(session: Session, c: store.Claimed = claimed, why: str = why) -> None:
                store.touch(
                    session, c, actor=self.worker, note=why, looked=False,
                    recheck_at=c.now + timedelta(seconds=HOLD_SECONDS),
                    evidence={"held": why, "sent": False},
                )  # fmt: skip

            try:
                in_transaction(self.sessions, hold)
            except SettledError:  # StaleLease: a newer claim holds it
                continue
            held[claimed.id] = claimed.state
        return held

    def _send(self, batch: list[tuple[store.Claimed, Kind, DbClock]]) -> list[Sent]:
        if len(batch) <= 1:
            return [self._send_one(*one) for one in batch]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=max(1, self.max_batch), thread_name_prefix="settled-send"
            )
        return list(self._pool.map(lambda one: self._send_one(*one), batch))

    def send_deadline(self, claimed: store.Claimed, clock: DbClock) -> Deadline:
        """When this attempt must be over: the operation's deadline, or its lease's end less
        the clock margin, whichever comes first (database time)."""
        lease_end = claimed.lease_until - timedelta(seconds=self.clock_margin)
        return clock.deadline(min(claimed.deadline, lease_end))

    def _send_one(self, claimed: store.Claimed, kind: Kind, clock: DbClock) -> Sent:
        deadline = self.send_deadline(claimed, clock)
        outcome: SubmitOutcome
        if deadline.left() <= 0:
            # Delayed past the lease (a pause, a queue): another worker or the reconciler may
            # own the operation now. Provably nothing was sent.
            log.warning("not sent: the lease ended first", extra={"operation_id": claimed.id})
            outcome = NotSent("the lease ended before sending")
        else:
            outcome = self.gateway.submit(
                tenant=claimed.tenant,
                kind=kind,
                idempotency_key=claimed.idempotency_key,
                params=claimed.params,
                deadline=deadline,
            )
        return Sent(claimed, kind, outcome, clock.now())

    def _record(self, batch: list[Sent]) -> dict[int, State]:
        """Write the outcomes of a batch, each under its own lease version.

        A stale lease (a newer claim took the operation over) skips that operation only: its
        fenced UPDATE matched no row and nothing else of it is written; the others are written.
        """
        judged = [(sent, self._judge(sent)) for sent in batch]
        moves = [self._move(sent.claimed, verdict) for sent, verdict in judged]
        finishes = [_finish(sent) for sent, _ in judged]
        written: dict[int, State] = {}
        try:
            done = self._step(
                lambda conn: store.record(conn, moves, actor=self.worker, finishes=finishes)
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
            done, written = self._record_each(moves, finishes)
        for sent, verdict in judged:
            if sent.claimed.id in done and sent.claimed.id not in written:
                written[sent.claimed.id] = verdict.to
                log.info(
                    "attempt recorded",
                    extra={
                        "operation_id": sent.claimed.id,
                        "attempt": sent.claimed.attempts,
                        "proof": sent.outcome.proof.value,
                        "state": verdict.to.value,
                    },
                )
        return written

    def _judge(self, sent: Sent) -> Verdict:
        claimed = sent.claimed
        return judge_submit(
            sent.outcome,
            budget=Budget(claimed.attempts, claimed.max_attempts, claimed.deadline),
            contract=sent.kind.contract,
            now=sent.at,
            rand=self.rand,
        )

    def _record_each(
        self, moves: Sequence[store.Move], finishes: Sequence[store.Finish]
    ) -> tuple[set[int], dict[int, State]]:
        """Write each outcome alone; one the database refuses becomes ``unknown`` with a
        review item (its effect may have happened: it must not be lost, nor re-sent).
        Returns the ids written, and the states of those written otherwise than judged."""
        done: set[int] = set()
        instead: dict[int, State] = {}

        def alone(move: store.Move, finish: store.Finish) -> set[int]:
            return self._step(
                lambda conn: store.record(conn, [move], actor=self.worker, finishes=[finish])
            )

        for one, finish in zip(moves, finishes, strict=True):
            try:
                done |= alone(one, finish)
                continue
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise
                error = type(exc.orig).__name__
            log.error(
                "outcome refused by the database; to review",
                extra={"operation_id": one.claimed.id, "error": error},
            )
            evidence = {"detail": "the database refused the outcome", "error": error}
            fallback = store.Move(
                one.claimed, Event.LOSE, State.UNKNOWN, evidence=evidence,
                review="outcome_not_recorded",
            )  # fmt: skip
            proof = store.Finish(one.claimed, finish.proof, finish.status_code, {"error": error})
            try:
                if alone(fallback, proof):
                    done.add(one.claimed.id)
                    instead[one.claimed.id] = State.UNKNOWN
            except DBAPIError:
                # Left submitted under an expiring lease: the reconciler will look it up.
                log.exception(
                    "could not record the operation", extra={"operation_id": one.claimed.id}
                )
        return done, instead

    def _recover(self, claimed: store.Claimed, clock: DbClock) -> dict[int, State]:
        """The worker that sent this died before recording: ask, never re-send."""
        try:
            kind = self.registry.get(claimed.kind)
        except SettledError:
            log.error("cannot look up an unknown kind", extra={"operation_id": claimed.id})
            return {}
        if kind.contract.queryable:
            deadline = lookup_deadline(clock, claimed, self.lease_seconds / 2)
            found = look_up(self.gateway, claimed, kind, deadline=deadline)
            verdict = judge_recovery(found)
        else:
            verdict = judge_recovery(None)
        move = self._move(claimed, verdict, lookups=kind.contract.queryable)
        if not self._step(lambda conn: store.record(conn, [move], actor=self.worker)):
            return {}  # refused as stale: a newer claim holds it
        return {claimed.id: verdict.to}

    def _move(self, claimed: store.Claimed, verdict: Verdict, lookups: bool = False) -> store.Move:
        values: dict[str, Any] = {}
        if verdict.next_attempt_at is not None:
            values["next_attempt_at"] = verdict.next_attempt_at
        return store.Move(
            claimed,
            verdict.event,
            verdict.to,
            reason=verdict.reason,
            evidence=verdict.evidence or None,
            values=values,
            review=verdict.review,
            receipt=verdict.receipt,
            looked=lookups,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._keeper is not None:
            self._keeper.close()


def _finish(sent: Sent) -> store.Finish:
    outcome = sent.outcome
    return store.Finish(sent.claimed, outcome.proof.value, _status(outcome), _detail(outcome))


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
