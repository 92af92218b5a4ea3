"""The same-key resend of an unknown operation: when the reconcile decision asks for it, and
what each answer to it proves (``reconciler.decide``, ``workers.verdicts.judge_resend``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from outbox.downstream import (
    Accepted,
    Found,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.kinds import DownstreamContract
from outbox.states import Event, RejectReason, State
from reconciler.decide import decide
from tests.unit.test_decide import NOW, OK, situation
from workers.verdicts import judge_resend

CONTRACT = DownstreamContract()


@pytest.mark.parametrize("contract", ["idempotent", "unfenced"])
def test_a_not_found_before_quiescence_is_sent_again_with_the_same_key(contract: str) -> None:
    s = replace(situation(State.UNKNOWN, contract, "fresh"), resend=True)
    d = decide(s, LookupNotFound())
    assert (d.event, d.to, d.code) == (Event.RESEND, State.SUBMITTED, "resent")
    assert d.evidence["resend"] == "same_key" and d.evidence["lookup"] == "not_found"
    assert d.evidence["quiet_at"] == s.quiet_at.isoformat()  # "not done" still waits for it


def test_an_idempotent_downstream_without_lookups_is_asked_by_a_same_key_resend() -> None:
    s = replace(situation(State.UNKNOWN, "idempotent", "quiet"), resend=True)
    s = replace(s, contract=replace(s.contract, queryable=False))
    d = decide(s, None)
    assert (d.event, d.evidence["lookup"]) == (Event.RESEND, "none")


@pytest.mark.parametrize(
    ("why", "change"),
    [
        ("the reconciler cannot resend", {"resend": False}),
        ("a person owns it", {"in_review": True}),
        ("the database's clock just stepped", {"clock_doubt_until": NOW}),
    ],
)
def test_no_resend_where_the_rule_does_not_allow_it(why: str, change: dict[str, object]) -> None:
    s = replace(replace(situation(State.UNKNOWN, "idempotent", "fresh"), resend=True), **change)  # type: ignore[arg-type]
    d = decide(s, LookupNotFound())
    assert d.event is None, why  # it waits, as without the rule
    assert d.code in ("wait_quiescence", "wait_clock_step", "in_review"), why


def test_no_resend_without_idempotency() -> None:
    s = replace(situation(State.UNKNOWN, "not_idempotent", "fresh"), resend=True)
    for lookup in (LookupNotFound(), None):
        d = decide(s, lookup)
        assert d.event is None and d.review is not None


@pytest.mark.parametrize(
    "lookup", [OK, Unavailable("503"), Unavailable("pending")], ids=["found", "down", "pending"]
)
def test_what_a_lookup_proves_comes_first(lookup: LookupOutcome) -> None:
    s = replace(situation(State.UNKNOWN, "idempotent", "fresh"), resend=True)
    assert decide(s, lookup).event is not Event.RESEND


def test_a_quiet_not_found_is_requeued_not_resent() -> None:
    s = replace(situation(State.UNKNOWN, "idempotent", "quiet"), resend=True)
    assert decide(s, LookupNotFound()).event is Event.REQUEUE


def test_a_dead_workers_send_is_first_recorded_unknown() -> None:
    s = replace(situation(State.SUBMITTED, "idempotent", "fresh"), resend=True)
    assert decide(s, LookupNotFound()).event is Event.ABANDON


RECEIPT = Receipt("re_1", "succeeded", {"amount_minor": 100})
#: still unknown, nothing concluded
STAYS = (Event.LOSE, State.UNKNOWN, None)


def judged(outcome: SubmitOutcome) -> tuple[Event | None, State | None, RejectReason | None]:
    change = judge_resend(outcome, contract=CONTRACT, now=NOW)
    return change.event, change.to, change.reason


@pytest.mark.parametrize(
    ("outcome", "want"),
    [
        (Accepted(RECEIPT), (Event.ACCEPT, State.SUCCEEDED, None)),
        # the key's record, applied once no other request can land (below)
        (Refused(RejectReason.BUSINESS_REJECTED, "order_closed", 402), STAYS),
        (Refused(RejectReason.INVALID_PARAMS, "bad_amount", 400), STAYS),
        # an earlier request may have passed before our credentials broke
        (Refused(RejectReason.PERMISSION_DENIED, "http_401", 401), STAYS),
        (NotSent("refused", SendPhase.CONNECT), STAYS),
        (NotExecuted(429, 30.0), STAYS),
        (Unknown("an earlier request with this key is still in flight", 409), STAYS),
        (Unknown("read timeout"), STAYS),
        (Misuse("receipt_mismatch", "amount differs", 200), STAYS),
    ],
    ids=["accepted", "business", "invalid", "credentials", "not_sent", "429", "in_flight",
         "timeout", "mismatch"],
)  # fmt: skip
def test_a_resend_settles_only_what_is_done(
    outcome: SubmitOutcome, want: tuple[Event, State, RejectReason | None]
) -> None:
    assert judged(outcome) == want


def test_a_resend_never_gives_up_even_with_nothing_left() -> None:
    """``judge_submit`` rejects ``not_executed`` once the budget is spent; a resend cannot:
    the earlier request may still land. It looks again once that request can have finished,
    and not before a ``Retry-After``."""
    not_sent = judge_resend(NotSent("refused"), contract=CONTRACT, now=NOW)
    assert not_sent.to is State.UNKNOWN and not_sent.reason is None
    assert not_sent.next_attempt_at == NOW + CONTRACT.processing_time
    throttled = judge_resend(NotExecuted(429, 30.0), contract=CONTRACT, now=NOW)
    assert throttled.next_attempt_at == NOW + timedelta(seconds=30)
    in_flight = judge_resend(Unknown("in flight", 409), contract=CONTRACT, now=NOW)
    assert in_flight.next_attempt_at == NOW + CONTRACT.processing_time


def test_a_replay_unlike_the_intent_is_misuse_for_review_never_success() -> None:
    change = judge_resend(
        Misuse("receipt_mismatch", "amount differs", 200), contract=CONTRACT, now=NOW
    )
    assert change.review == "receipt_mismatch" and change.to is State.UNKNOWN


def test_a_refusal_found_after_a_resend_waits_until_no_other_request_can_land() -> None:
    """The key's record says "refused", but the request it followed (or the resend) may still
    be on the wire: "not done" waits for quiescence, as every "not done" does."""
    s = replace(situation(State.UNKNOWN, "idempotent", "fresh"), resend=True)
    start, end = s.sends[0] if s.sends else (NOW, NOW)
    two = replace(s, sends=((start, end), (NOW, NOW)), lease_ends=(end, NOW))
    waits = decide(two, REFUSED_RECORD)
    assert (waits.event, waits.code) == (None, "wait_quiescence")
    assert waits.next_attempt_at == two.quiet_at
    quiet = replace(two, asked_at=two.quiet_at)
    assert (decide(quiet, REFUSED_RECORD).to, decide(quiet, REFUSED_RECORD).reason) == (
        State.REJECTED,
        RejectReason.BUSINESS_REJECTED,
    )


def test_a_refusal_found_for_the_only_attempt_is_rejected_at_once() -> None:
    s = situation(State.UNKNOWN, "idempotent", "fresh")
    one = replace(s, sends=((NOW, NOW),), lease_ends=(NOW,))
    assert decide(one, REFUSED_RECORD).to is State.REJECTED


REFUSED_RECORD = Found(Receipt("re_2", "rejected", {}), RejectReason.BUSINESS_REJECTED, "closed")


def test_a_resend_that_did_not_execute_without_retry_after_waits_only_the_processing_time() -> None:
    """No ``Retry-After`` adds no wait of its own: a downstream whose results show at once
    (``processing_seconds`` may be 0) is looked at again at once."""
    for processing in (timedelta(0), timedelta(milliseconds=500)):
        contract = replace(CONTRACT, processing_time=processing)
        for outcome in (NotSent("refused", SendPhase.CONNECT), NotExecuted(503)):
            change = judge_resend(outcome, contract=contract, now=NOW)
            assert change.next_attempt_at == NOW + processing, (processing, outcome)


@pytest.mark.parametrize(
    ("reason", "fault"),
    [(RejectReason.PERMISSION_DENIED, {"fault": "credentials"}),
     (RejectReason.BUSINESS_REJECTED, {}), (RejectReason.INVALID_PARAMS, {})],
    ids=["credentials", "business", "invalid"],
)  # fmt: skip
def test_a_resend_refused_names_our_credentials_as_the_fault_and_only_them(
    reason: RejectReason, fault: dict[str, object]
) -> None:
    change = judge_resend(Refused(reason, "code_1", 401), contract=CONTRACT, now=NOW)
    assert change.evidence == {
        "code": "code_1", "status": 401, "resend": "refused", "reason": reason.value, **fault,
    }  # fmt: skip
    assert change.next_attempt_at == NOW  # looked up at once
