"""The executor's, the reconciler's and the review queue's guarantee tests, run again against the
simulator's Alipay mode through the Alipay gateway (signed form requests, signed answers): one
effect per key and truthful states, with the same faults and the same ledger as the wire
protocol's and the Stripe mode's runs; what nobody can settle goes to review, and staff
resolve it. And what is Alipay's own: a repeat answered ``fund_change`` ``N`` is settled by the
query, and a refund still processing (the query empty) is never sent again before quiescence.

Each guarantee here is an existing test, run on ``alipay_rig``, so it is stated once and
checked in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from outbox import logs
from outbox.downstream import DownstreamRequest, Unknown
from outbox.states import State
from settled.simulator.alipay import TAKEN_ON_THEN_CLOSED
from tests.integration import test_executor as executor_tests
from tests.integration import test_reconciler as reconciler_tests
from tests.integration import test_review as review_tests
from tests.integration import test_review_reasons as reason_tests
from tests.integration.test_stripe_mode import GUARANTEES, REASONS, REVIEWS
from tests.support.rig import GOOD, HOLD, Rig


@pytest.mark.parametrize("guarantee", GUARANTEES, ids=lambda test: test.__name__[5:])
def test_guarantee_holds_in_alipay_mode(alipay_rig: Rig, guarantee: Callable[[Rig], None]) -> None:
    guarantee(alipay_rig)


@pytest.mark.parametrize("fault", ["commit_then_timeout", "reset_before"])
def test_unknown_from_either_side_of_the_commit_ends_succeeded_once_in_alipay_mode(
    alipay_rig: Rig, fault: str
) -> None:
    reconciler_tests.test_unknown_from_either_side_of_the_commit_ends_succeeded_once(
        alipay_rig, fault
    )


# Once, on PostgreSQL: the wire format is what differs here, not the database.
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("review", REVIEWS, ids=lambda test: test.__name__[5:])
def test_review_works_in_alipay_mode(alipay_rig: Rig, review: Callable[[Rig], None]) -> None:
    review(alipay_rig)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("reason", REASONS)
def test_review_reason_has_a_way_out_in_alipay_mode(alipay_rig: Rig, reason: str) -> None:
    reason_tests.way_out(alipay_rig, reason)


def test_a_repeat_answered_fund_change_n_is_settled_by_the_query(alipay_rig: Rig) -> None:
    """The refund was made and its answer lost; sent again (the same refund number), Alipay
    answers ``fund_change`` ``N``: no money moved *this* time. That is no proof of "not done":
    the operation stays unknown, and the query finds the refund made the first time."""
    rig = alipay_rig
    rig.control.add_rule("commit_then_reset", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown" and rig.effects(op) == 1
    request = DownstreamRequest.of(rig.op(op), rig.outbox.registry.get("refund"))
    repeat = rig.gateway().submit(request, deadline=datetime.now(UTC) + timedelta(seconds=5))
    assert isinstance(repeat, Unknown) and "fund_change N" in repeat.detail, repeat
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1 and rig.sends(op) == 2


def test_a_refund_still_processing_is_never_sent_again_before_quiescence(
    alipay_rig: Rig,
) -> None:
    """The refund is made but the query shows nothing yet (Alipay still processing it: the
    ``lookup_visibility_delay`` switch). An empty answer is "not found as far as Alipay shows
    now": inside Alipay's processing time and delay bound the reconciler sends nothing and
    looks again; once the refund shows, it is succeeded, with one effect."""
    rig = alipay_rig
    rig.control.set_switches(lookup_visibility_delay=3600.0)
    rig.control.add_rule("commit_then_reset", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    key = rig.op(op).idempotency_key
    outcomes = rig.reconciler().run_once().outcomes
    assert "requeued" not in outcomes and "found" not in outcomes, outcomes
    assert rig.control.requests("acme", key, phase="lookup") == 1  # asked; shown nothing
    assert rig.op(op).state == "unknown" and rig.sends(op) == 1
    rig.control.set_switches(lookup_visibility_delay=0.0)  # Alipay has made it
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == State.SUCCEEDED
    assert rig.effects(op) == 1 and rig.sends(op) == 1


def test_a_refund_alipay_does_not_show_past_quiescence_is_sent_again_with_the_same_number(
    alipay_rig: Rig,
) -> None:
    """Refused before it was made (a reset before processing): the query stays empty; past
    Alipay's processing time and delay bound the refund is sent again with the same
    ``out_request_no``, and made once."""
    reconciler_tests.test_not_found_after_quiescence_is_sent_again_with_the_same_key(alipay_rig)


def test_the_review_queue_sees_alipay_refusals_as_the_wire_protocol_does(alipay_rig: Rig) -> None:
    review_tests.test_requery_settles_when_the_lookup_is_back(alipay_rig)


@pytest.mark.usefixtures("settled_logging")
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_no_key_order_amount_or_payee_reaches_the_log_in_alipay_mode(
    alipay_rig: Rig, level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refund, a refusal and a lost answer settled by the query, with Settled's logging at
    ``level``: the app's private key, the order, the amounts and the payee are never heard."""
    rig = alipay_rig
    assert rig.alipay is not None
    logs.configure(level, "json")
    capsys.readouterr()
    executor_tests.test_happy_path_records_the_receipt(rig)
    refused = rig.enqueue("op-refused", params={**GOOD, "amount_minor": 987654})
    rig.executor().execute([refused])
    assert rig.op(refused).state == "rejected"
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    lost = rig.enqueue("op-lost", params={**GOOD, "amount_minor": 4321})
    rig.executor().execute([lost])
    assert rig.op(lost).state == "unknown"
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    written = capsys.readouterr()
    text = written.out + written.err
    assert '"logger": "workers.alipay_gateway"' in written.err  # the capture works
    key_lines = rig.alipay.private_key.get_secret_value().splitlines()[1:4]
    for secret in ("A1042", "P-7", "10000", "100.00", "987654", "9876.54", "43.21", *key_lines):
        assert secret not in text, secret


def test_a_refund_taken_on_then_closed_is_never_read_as_done_or_as_refused(
    alipay_rig: Rig,
) -> None:
    """Alipay takes the refund on (``fund_change`` ``N``: no money moved) and then closes it
    unmade: the query never shows it. Nothing proves either outcome: the operation stays
    uncertain, is sent again with the same number only past quiescence, and no money moves."""
    rig = alipay_rig
    rig.control.add_rule("business_reject", times=1, code=TAKEN_ON_THEN_CLOSED)
    op = rig.enqueue()
    key = rig.op(op).idempotency_key
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    assert "requeued" not in rig.reconciler().run_once().outcomes  # inside quiescence
    assert rig.sends(op) == 1 and rig.op(op).state == "unknown"
    rig.make_quiet(op)
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    assert rig.op(op).state == "planned" and rig.op(op).idempotency_key == key
    rig.executor().execute([op])  # the same number: Alipay answers it as before
    assert rig.op(op).state == "unknown"
    assert rig.effects(op) == 0 and rig.sends(op) == 2
    assert rig.control.refunded("acme", "A1042") == 0
