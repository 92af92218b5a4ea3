"""The executor's third step: write the outcomes of a batch, each under its own lease
version, with the event rows (``Executor`` in ``workers.executor``).

A stale lease skips that operation only. An outcome the database refuses to store is written
alone; failing that, the operation goes to ``unknown`` and review. While the database is away
(``outbox.outage.database_away``: unreachable, not refusing) the outcomes wait in memory and
are written again until it answers, for up to ``outcome_patience`` seconds: nothing is put in
review, and the outage is said once for the process (``DatabaseOutage``); past that the
operations are left ``submitted`` under their lapsing leases, and the reconciler looks them up.
The lines written here are the executor's (logger ``workers.executor``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from outbox.change import Change
from outbox.downstream import Accepted, Refused, SubmitOutcome
from outbox.kinds import Kind
from outbox.observer import Observer, guarded
from outbox.outage import DatabaseOutage, database_away
from outbox.states import ConfigFault, Event, State
from outbox.storage import Storage
from outbox.storage.claims import Claimed
from outbox.storage.transitions import Finish, Transition
from workers.verdicts import Budget, judge_resend, judge_submit
from workers.waking import WakesWaiting

log = logging.getLogger("workers.executor")

T = TypeVar("T")


@dataclass(frozen=True)
class Sent:
    claimed: Claimed
    kind: Kind
    outcome: SubmitOutcome
    #: database time when the outcome came back (estimated on the monotonic clock)
    at: datetime
    #: a same-key resend of an unknown operation (``Executor.resend``): judged as such
    resent: bool = False


class RecordsOutcomes(WakesWaiting):
    """The executor's outcome writing (a part of ``Executor``, which has what it uses)."""

    worker: str
    max_tries: int
    rand: Callable[[], float]
    observer: Observer
    outage: DatabaseOutage
    outcome_patience: float

    @property
    def storage(self) -> Storage:
        raise NotImplementedError

    def _step(self, work: Callable[[Connection], T]) -> T:
        raise NotImplementedError

    def _write_step(self, work: Callable[[Connection], T], *, waiting: int) -> T:
        """``_step(work)``, run again while the database is away (``waiting`` outcomes kept
        meanwhile), for up to ``outcome_patience`` seconds from the first failure; past that
        the last error is raised. Every write of an outcome step is conditional and fenced:
        one that did commit before its connection was lost is refused as stale when run
        again, never applied twice."""
        pause, end = 0.1, None
        while True:
            try:
                result = self._step(work)
            except DBAPIError as exc:
                if not self.outage.away(exc, waiting=waiting if end is None else 0):
                    raise
                now = time.monotonic()  # real time: the outage's, not an injected clock
                end = now + self.outcome_patience if end is None else end
                if now + pause > end:
                    self.outage.gave_up(waiting)
                    log.error(
                        "outcomes not written: the database stayed unreachable; left "
                        "submitted, the reconciler looks them up",
                        extra={"operations": waiting, "error": type(exc.orig).__name__},
                    )
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 2.0)
                continue
            self.outage.back()
            return result

    def _record(self, batch: list[Sent]) -> dict[int, State]:
        """``_write_outcomes``, inside the observer's ``recording``; then the wake of what
        waits for a downstream these answers prove back (``workers.waking``)."""
        outcomes = [(sent.claimed, sent.outcome) for sent in batch]
        with guarded(self.observer).recording(outcomes) as seen:
            written = self._write_outcomes(batch)
            seen(written)
        self._wake_after([(sent.claimed, sent.kind, sent.outcome) for sent in batch])
        return written

    def _write_outcomes(self, batch: list[Sent]) -> dict[int, State]:
        """Write the outcomes of a batch, each under its own lease version.

        A stale lease (a newer claim took the operation over) skips that operation only: its
        fenced UPDATE matched no row and nothing else of it is written; the others are written.
        """
        judged = [(sent, self._judge(sent)) for sent in batch]
        transitions = [Transition.of(sent.claimed, change) for sent, change in judged]
        finishes = [_finish(sent) for sent, _ in judged]
        written: dict[int, State] = {}
        try:
            done = self._write_step(
                lambda conn: self.storage.write_transitions(
                    conn, transitions, actor=self.worker, finishes=finishes
                ),
                waiting=len(transitions),
            )
        except DBAPIError as exc:
            if database_away(exc):
                raise  # unreachable past the patience: nothing here was refused
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
        if sent.resent:
            return judge_resend(sent.outcome, contract=sent.kind.contract, now=sent.at)
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
            return self._write_step(
                lambda conn: self.storage.write_transitions(
                    conn, [transition], actor=self.worker, finishes=[finish]
                ),
                waiting=1,
            )

        for one, finish in zip(transitions, finishes, strict=True):
            claimed = finish.claimed
            try:
                done |= alone(one, finish)
                continue
            except DBAPIError as exc:
                if database_away(exc):
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
            except DBAPIError as exc:
                if database_away(exc):
                    raise
                # Left submitted under an expiring lease: the reconciler will look it up.
                log.exception("could not record the operation", extra={"operation_id": claimed.id})
        return done, instead


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
        detail: dict[str, Any] = {"reference": outcome.receipt.reference}
        if outcome.request_id is not None:
            detail["request_id"] = outcome.request_id
        return detail
    detail = {
        k: v
        for k, v in vars(outcome).items()
        if k not in ("proof", "receipt") and isinstance(v, str | int | float | type(None))
    }
    if isinstance(outcome, Refused):
        detail["reason"] = outcome.reason.value
    return detail
