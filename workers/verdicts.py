"""What the executor does with an outcome: pure functions from values to a ``Change``.

No database, clock or network in here: ``now`` and ``rand`` are passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from outbox.change import Change
from outbox.downstream import (
    Accepted,
    Found,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Refused,
    SubmitOutcome,
    Unknown,
    lookup_name,
    settlement,
)
from outbox.kinds import DownstreamContract
from outbox.retry import DEFAULT_MAX_TRIES, RetryAt, RetryPolicy, next_retry
from outbox.states import ConfigFault, Event, RejectReason, State


@dataclass(frozen=True)
class Budget:
    """What an operation has spent, with the attempt being judged counted in."""

    #: every attempt started, this one included (those whose request never left too)
    tries: int
    #: attempts that may have reached the downstream, this one included (until its outcome
    #: proves it never left): what ``max_attempts`` counts
    reached: int
    max_attempts: int
    deadline: datetime


def judge_submit(
    outcome: SubmitOutcome,
    *,
    budget: Budget,
    contract: DownstreamContract,
    now: datetime,
    rand: Callable[[], float],
    max_tries: int = DEFAULT_MAX_TRIES,
) -> Change:
    """The change one attempt's outcome calls for (DESIGN.md, "What an outcome proves").

    A send that provably did not execute is tried again by time (``outbox.retry``), waiting
    up to the contract's ``retry_cap``; a request that never left (``NotSent``) is not counted
    against ``max_attempts``."""
    match outcome:
        case Accepted(receipt=receipt):
            return Change(Event.ACCEPT, State.SUCCEEDED, receipt=receipt.as_dict())
        case Refused(reason=reason, code=code, status=status):
            evidence = _answered({"code": code, "status": status}, outcome.request_id)
            # A 401/403 (or no API key here) refuses our credentials, not the customer: the
            # fault is ours, and it is said so (docs/observability.md, "Alerts").
            ours = reason is RejectReason.PERMISSION_DENIED
            if ours:
                evidence["fault"] = "credentials"
            return Change(
                Event.REFUSE,
                State.REJECTED,
                reason=reason,
                evidence=evidence,
                note=ConfigFault.CREDENTIALS_REFUSED if ours else None,
            )
        case NotSent() | NotExecuted():
            retry_after = outcome.retry_after if isinstance(outcome, NotExecuted) else None
            if isinstance(outcome, NotExecuted) and not contract.idempotent:
                # Without idempotency only one automatic send is allowed, and this was it.
                return _give_up("one_send_without_idempotency")
            # The budget counts what reached the downstream: a request that never left did not.
            reached = budget.reached - 1 if isinstance(outcome, NotSent) else budget.reached
            decision = next_retry(
                tries=budget.tries,
                reached=reached,
                max_attempts=budget.max_attempts,
                deadline=budget.deadline,
                now=now,
                retry_after=retry_after,
                policy=retry_policy(contract, max_tries),
                rand=rand,
            )
            if isinstance(decision, RetryAt):
                # When the backoff said to try again, kept: a wake (``workers.waking``) may
                # bring it forward, and the audit trail then shows by how much.
                waits: dict[str, object] = {"retry_at": decision.when.isoformat()}
                if retry_after is not None:
                    waits["retry_after"] = retry_after
                return Change(
                    Event.DEFER, State.PLANNED, next_attempt_at=decision.when, evidence=waits
                )
            return _give_up(decision.reason, tries=budget.tries, reached=reached)
        case Unknown(detail=detail, status=status):
            review = None
            if not contract.idempotent and not contract.queryable:
                review = "ambiguous_without_idempotency_or_lookup"
            return Change(
                Event.LOSE,
                State.UNKNOWN,
                review=review,
                evidence=_answered({"detail": detail, "status": status}, outcome.request_id),
            )
        case Misuse():
            return _misused(outcome)
    raise TypeError(f"not a submit outcome: {outcome!r}")  # pragma: no cover


def judge_resend(outcome: SubmitOutcome, *, contract: DownstreamContract, now: datetime) -> Change:
    """The change a same-key resend of an ``unknown`` operation calls for.

    An earlier request of the operation may still land (that is why it was unknown), so
    nothing here says "not done": an acceptance settles it (done needs no wait), and
    everything else leaves it ``unknown`` for the reconciler. A refusal is looked up at once
    (a business refusal is the key's record, which the reconciler applies once no other
    request can land: ``reconciler.decide``; a refusal of our credentials proves nothing of an
    earlier request); no answer and an in-flight answer (the first request still runs) are
    looked at again once that request can have finished; a request that never left or did not
    execute not before its ``Retry-After``. A replay unlike the intent is misuse: unknown, and
    review at once."""
    match outcome:
        case Accepted(receipt=receipt):
            return Change(Event.ACCEPT, State.SUCCEEDED, receipt=receipt.as_dict())
        case Refused(reason=reason, code=code, status=status):
            refused: dict[str, object] = {
                "code": code,
                "status": status,
                "resend": "refused",
                "reason": reason.value,
            }
            if reason is RejectReason.PERMISSION_DENIED:
                refused["fault"] = "credentials"
            return Change(
                Event.LOSE,
                State.UNKNOWN,
                evidence=_answered(refused, outcome.request_id),
                next_attempt_at=now,
            )
        case NotSent() | NotExecuted():
            retry_after = outcome.retry_after if isinstance(outcome, NotExecuted) else None
            wait = max(timedelta(seconds=retry_after or 0.0), contract.processing_time)
            said: dict[str, object] = (
                {"detail": outcome.detail}
                if isinstance(outcome, NotSent)
                else {"status": outcome.status, "retry_after": retry_after}
            )
            return Change(
                Event.LOSE,
                State.UNKNOWN,
                next_attempt_at=now + wait,
                evidence={"resend": outcome.proof.value, **said},
            )
        case Unknown(detail=detail, status=status):
            return Change(
                Event.LOSE,
                State.UNKNOWN,
                next_attempt_at=now + contract.processing_time,
                evidence=_answered({"detail": detail, "status": status}, outcome.request_id),
            )
        case Misuse():
            return _misused(outcome)
    raise TypeError(f"not a submit outcome: {outcome!r}")  # pragma: no cover


def _misused(outcome: Misuse) -> Change:
    """Misuse (an idempotency error, a receipt unlike the intent): unknown, and review at once,
    whether the first send or a resend met it."""
    return Change(
        Event.LOSE,
        State.UNKNOWN,
        review=outcome.code,
        evidence=_answered(
            {"detail": outcome.detail, "status": outcome.status}, outcome.request_id
        ),
    )


def _answered(evidence: dict[str, object], request_id: str | None) -> dict[str, object]:
    """``evidence`` with the downstream's id for the request, where it gave one (support quotes
    it to the downstream: Stripe's ``Request-Id``)."""
    return {**evidence, "request_id": request_id} if request_id is not None else evidence


def retry_policy(contract: DownstreamContract, max_tries: int = DEFAULT_MAX_TRIES) -> RetryPolicy:
    """How a kind's sends that did not execute are tried again: up to its contract's cap."""
    return RetryPolicy(cap=contract.retry_cap.total_seconds(), max_tries=max_tries)


def _give_up(why: str, **spent: int) -> Change:
    """Rejected ``not_executed``: ``why`` names the limit (``outbox.retry.STOPS``), ``spent``
    the tries made and the attempts of them that reached the downstream."""
    return Change(
        Event.GIVE_UP,
        State.REJECTED,
        reason=RejectReason.NOT_EXECUTED,
        evidence={"stop": why, **spent},
    )


def judge_recovery(found: LookupOutcome | None) -> Change:
    """A submitted operation whose worker died mid-send: settle it only from a lookup.

    ``found`` is None where the downstream has no lookup.
    """
    if isinstance(found, Found):
        settled = settlement(found)
        return Change(
            Event.FIND,
            settled.state,
            reason=settled.reason,
            receipt=settled.receipt,
            evidence=settled.evidence,
        )
    lookup = lookup_name(found)
    return Change(
        Event.ABANDON,
        State.UNKNOWN,
        evidence={"detail": "worker lost during send", "lookup": lookup},
    )


def check_before_send(
    *,
    now: datetime,
    deadline: datetime,
    attempts: int,
    max_attempts: int,
    reached_downstream: int,
    first_sent_at: datetime | None,
    contract: DownstreamContract,
    run_cancelled: bool,
    fingerprint_ok: bool,
    max_tries: int = DEFAULT_MAX_TRIES,
) -> Change | None:
    """The last checks before a send: None to send it, else the change that stops it (why, in
    its evidence's ``stop``). ``attempts`` counts every try made; ``reached_downstream`` the
    attempts not proven unsent, which is what ``max_attempts`` bounds."""
    if run_cancelled:
        return Change(
            Event.CANCEL, State.CANCELLED, evidence={"stop": "run_cancelled", "sent": False}
        )
    stop: str | None = None
    if not fingerprint_ok:
        stop = "fingerprint_mismatch"
    elif now >= deadline:
        stop = "deadline_passed"
    elif reached_downstream >= max_attempts:
        stop = "attempts_exhausted"
    elif attempts >= max_tries:
        stop = "tries_exhausted"
    elif first_sent_at is not None and now >= contract.resend_until(first_sent_at):
        stop = "key_retention_passed"
    elif not contract.idempotent and reached_downstream >= 1:
        stop = "one_send_without_idempotency"
    if stop is None:
        return None
    # A mismatch is never sent (the row may have been altered), and a person looks at it.
    mismatch = ConfigFault.FINGERPRINT_MISMATCH if stop == "fingerprint_mismatch" else None
    spent = {"tries": attempts, "reached": reached_downstream}
    return Change(
        Event.GIVE_UP,
        State.REJECTED,
        reason=RejectReason.NOT_EXECUTED,
        evidence={"stop": stop, "sent": False, **spent},
        review=mismatch,
        note=mismatch,
    )
