"""The executor: claim, send, record. The one place retries are decided (through the row).

1. claim the hinted operations by a conditional update (lease in database time, fencing
   version bumped); re-check cancel flag, fingerprint and budget; write the attempt row and
   ``submitted``, committed before anything is sent.
2. send each with the stored idempotency key and the remaining deadline, no transaction open
   (a batch is sent concurrently).
3. write the outcomes of the batch, each under its own lease version (a stale worker's write
   is refused and skips that operation only), with the event rows; a not-sent / not-executed
   outcome schedules ``next_attempt_at`` or stops.
An operation found ``submitted`` with an expired lease may have been sent: it is only queried.

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
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from outbox import store
from outbox.errors import InvalidInput
from outbox.fingerprint import Fingerprinter
from outbox.kinds import Kind, KindRegistry
from outbox.states import State
from workers.failpoints import failpoint
from workers.gateway import Accepted, Gateway, Refused, SubmitOutcome, look_up
from workers.verdicts import Budget, Verdict, check_before_send, judge_recovery, judge_submit

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    elapsed: float


@dataclass
class Executor:
    """The service behind the submit task; built once per worker process."""

    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    fingerprinter: Fingerprinter
    worker: str
    lease_seconds: float = 60.0
    #: due operations claimed beside the hinted ones, sent concurrently
    batch_extra: int = 0
    rand: Callable[[], float] = random.random
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
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
        to_send, to_recover, written = self._claim(ids)
        for claimed in to_recover:
            written.update(self._recover(claimed))
        failpoint("after_claim")
        sent = self._send(to_send)
        if sent:
            failpoint("after_send")
            written.update(self._record(sent))
        failpoint("after_outcome")
        return written

    def _claim(
        self, ids: Sequence[int]
    ) -> tuple[list[tuple[store.Claimed, Kind]], list[store.Claimed], dict[int, State]]:
        return self._step(lambda conn: self._claim_in(conn, ids))

    def _claim_in(
        self, conn: Connection, ids: Sequence[int]
    ) -> tuple[list[tuple[store.Claimed, Kind]], list[store.Claimed], dict[int, State]]:
        to_recover: list[store.Claimed] = []
        stops: list[tuple[store.Move, str]] = []
        claims = store.claim_for_send(
            conn,
            worker=self.worker,
            lease_seconds=self.lease_seconds,
            ids=ids,
            extra=self.batch_extra,
        )
        cancelled = store.cancelled_runs(conn, (c.run_id for c in claims))
        fresh: list[tuple[store.Claimed, Kind]] = []
        for claimed in claims:
            if claimed.state is State.SUBMITTED:
                to_recover.append(claimed)
                continue
            kind = self.registry.get(claimed.kind)
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
                fingerprint_ok=self._fingerprint_ok(claimed, kind),
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
        return [(c, kinds[c.id]) for c in started], to_recover, written

    def _fingerprint_ok(self, claimed: store.Claimed, kind: Kind) -> bool:
        try:
            intent = kind.parse(claimed.params)
        except InvalidInput:
            return False
        return self.fingerprinter.matches(
            kind.name, intent, claimed.fingerprint_key_version, claimed.fingerprint
        )

    def _send(self, batch: list[tuple[store.Claimed, Kind]]) -> list[Sent]:
        if len(batch) <= 1:
            return [self._send_one(c, k) for c, k in batch]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="settled-send")
        return list(self._pool.map(lambda ck: self._send_one(*ck), batch))

    def _send_one(self, claimed: store.Claimed, kind: Kind) -> Sent:
        started = time.monotonic()
        outcome = self.gateway.submit(
            tenant=claimed.tenant,
            kind=kind,
            idempotency_key=claimed.idempotency_key,
            params=claimed.params,
            deadline=claimed.deadline,
        )
        return Sent(claimed, kind, outcome, time.monotonic() - started)

    def _record(self, batch: list[Sent]) -> dict[int, State]:
        """Write the outcomes of a batch, each under its own lease version.

        A stale lease (a newer claim took the operation over) skips that operation only: its
        fenced UPDATE matched no row and nothing else of it is written; the others are written.
        """
        judged = [(sent, self._judge(sent)) for sent in batch]
        moves = [self._move(sent.claimed, verdict) for sent, verdict in judged]
        finishes = [_finish(sent) for sent, _ in judged]
        done = self._step(
            lambda conn: store.record(conn, moves, actor=self.worker, finishes=finishes)
        )
        written: dict[int, State] = {}
        for sent, verdict in judged:
            if sent.claimed.id in done:
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
            now=claimed.now + timedelta(seconds=sent.elapsed),
            rand=self.rand,
        )

    def _recover(self, claimed: store.Claimed) -> dict[int, State]:
        """The worker that sent this died before recording: ask, never re-send."""
        kind = self.registry.get(claimed.kind)
        if kind.contract.queryable:
            found = look_up(self.gateway, claimed, kind, seconds=self.lease_seconds / 2)
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
