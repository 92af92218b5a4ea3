"""The one value every pure decision returns (``outbox.change``), and the one place it becomes
a write (``Transition.of``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.change import Change
from outbox.errors import IllegalTransition
from outbox.states import Event, RejectReason, State
from outbox.storage.claims import Claimed
from outbox.storage.transitions import Transition

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
LATER = NOW + timedelta(seconds=30)


def claimed(state: State = State.UNKNOWN) -> Claimed:
    return Claimed(
        id=7, tenant="t1", op_id="op-7", kind="refund", params={}, fingerprint="f",
        fingerprint_key_version="v1", idempotency_key="k7", state=state, attempts=1,
        max_attempts=5, deadline=NOW + timedelta(hours=1), first_sent_at=NOW, run_id=None,
        lease_version=3, lease_until=NOW + timedelta(seconds=15), now=NOW,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        {"event": Event.FIND},  # an event without its state
        {"event": None, "to": State.SUCCEEDED},  # a state without its event
        {"event": None},  # a look that does not say when to look again
    ],
)
def test_a_change_is_a_move_or_a_look_never_half_of_one(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"a change names|a look says"):
        Change(**kwargs)  # type: ignore[arg-type]


def test_a_move_back_to_planned_without_a_time_is_due_at_once() -> None:
    assert Change(Event.REQUEUE, State.PLANNED).due_now
    assert not Change(Event.DEFER, State.PLANNED, next_attempt_at=LATER).due_now
    assert not Change(Event.ABANDON, State.UNKNOWN).due_now


def test_stop_reads_why_a_send_was_stopped() -> None:
    assert Change(Event.GIVE_UP, State.REJECTED, evidence={"stop": "deadline_passed"}).stop == (
        "deadline_passed"
    )
    assert Change(Event.ACCEPT, State.SUCCEEDED).stop is None


def test_a_move_is_written_about_the_claim_with_everything_it_decided() -> None:
    change = Change(
        Event.FIND,
        State.REJECTED,
        reason=RejectReason.BUSINESS_REJECTED,
        receipt={"reference": "r1"},
        evidence={"lookup": "found"},
        code="found",
    )
    t = Transition.of(claimed(), change, looked=True)
    assert (t.id, t.from_state, t.event, t.to, t.reason) == (
        7,
        State.UNKNOWN,
        Event.FIND,
        State.REJECTED,
        RejectReason.BUSINESS_REJECTED,
    )
    assert (t.lease_version, t.receipt, t.evidence, t.looked, t.due_now) == (
        3,
        {"reference": "r1"},
        {"lookup": "found"},
        True,
        False,
    )
    assert t.settles_review  # leaving unknown closes the open review item


def test_a_requeue_is_due_at_once_and_a_look_changes_no_state() -> None:
    requeue = Transition.of(claimed(), Change(Event.REQUEUE, State.PLANNED))
    assert (requeue.to, requeue.due_now, requeue.next_attempt_at) == (State.PLANNED, True, None)
    look = Transition.of(
        claimed(), Change.look("to_review", recheck_at=LATER, review="lookup_unavailable")
    )
    assert (look.event, look.to, look.next_attempt_at) == (None, State.UNKNOWN, LATER)
    assert (look.review, look.event_reason, look.evidence) == (
        "lookup_unavailable",
        "to_review",
        None,
    )


def test_a_change_the_state_machine_forbids_is_refused_when_applied() -> None:
    with pytest.raises(IllegalTransition):
        Transition.of(claimed(State.SUCCEEDED), Change(Event.REQUEUE, State.PLANNED))
