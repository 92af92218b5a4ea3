"""The executor's, the reconciler's and the review queue's guarantee tests, run again against the
simulator's WeChat Pay mode through the WeChat Pay gateway (API v3: signed JSON, the refund's
``out_refund_no`` the stored key, queried by it): one effect per key and truthful states, with
the same faults and the same ledger as the wire protocol's runs; what nobody can settle goes to
review, and staff resolve it. And what only WeChat Pay answers: its business refusals, a refund
``PROCESSING`` that later succeeds, closes or turns abnormal.

Each guarantee here is an existing test, run on ``wechatpay_rig`` (a rig whose gateways speak
WeChat Pay), so the guarantees are stated once and checked in every mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from outbox import logs
from outbox.errors import ReviewConflict
from outbox.models import Operation
from outbox.settings import Settings
from settled.console.auth import ConsoleUser, current_user, require_csrf
from settled.simulator import SimulatorControl, start_in_thread
from settled.simulator.wechatpay import PREFIX as WECHATPAY_PREFIX
from settled.web import create_web_app
from support.review import ReviewQueue
from support.staff import Staff
from tests.integration import test_executor as executor_tests
from tests.integration import test_reconciler as reconciler_tests
from tests.integration import test_review as review_tests
from tests.integration import test_review_reasons as reason_tests
from tests.integration import test_stripe_mode as stripe_mode
from tests.integration.test_console_pages import ANN, CSRF
from tests.integration.test_review import in_review
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.wechatpay import control

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from fastapi.testclient import TestClient

#: Stripe mode's guarantees, all but the refund over the charged amount, which WeChat Pay refuses
#: as the caller's to fix, not as a business refusal (both tested below).
GUARANTEES: list[Callable[[Rig], None]] = [
    test
    for test in stripe_mode.GUARANTEES
    if test is not executor_tests.test_business_refusal_is_rejected_with_reason
]


@pytest.mark.parametrize("guarantee", GUARANTEES, ids=lambda test: test.__name__[5:])
def test_guarantee_holds_in_wechatpay_mode(
    wechatpay_rig: Rig, guarantee: Callable[[Rig], None]
) -> None:
    guarantee(wechatpay_rig)


@pytest.mark.parametrize("fault", ["commit_then_timeout", "reset_before"])
def test_unknown_from_either_side_of_the_commit_ends_succeeded_once(
    wechatpay_rig: Rig, fault: str
) -> None:
    reconciler_tests.test_unknown_from_either_side_of_the_commit_ends_succeeded_once(
        wechatpay_rig, fault
    )


#: The review queue's tests that ask the downstream (lookups behind staff's resolutions and
#: requeries, the CLI built from settings): an operation nobody can settle lands in review, a
#: mismatched receipt does too, and staff resolve them against WeChat Pay's record.
REVIEWS: list[Callable[[Rig], None]] = [
    review_tests.test_resolve_as_succeeded_is_verified_by_lookup_and_recorded,
    review_tests.test_a_resolution_that_contradicts_the_lookup_is_refused,
    review_tests.test_rejected_needs_a_justification_and_not_found_evidence,
    review_tests.test_requery_settles_when_the_lookup_is_back,
    review_tests.test_review_cli_end_to_end,
    reason_tests.test_a_receipt_mismatch_is_stored_as_what_the_downstream_did,
]


# Once, on PostgreSQL: the wire format is what differs here, not the database.
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("review", REVIEWS, ids=lambda test: test.__name__[5:])
def test_review_works_in_wechatpay_mode(wechatpay_rig: Rig, review: Callable[[Rig], None]) -> None:
    review(wechatpay_rig)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize(
    "reason", ["receipt_mismatch", "past_key_retention", "no_lookup_replay_cannot_settle"]
)
def test_review_reason_has_a_way_out_in_wechatpay_mode(wechatpay_rig: Rig, reason: str) -> None:
    reason_tests.way_out(wechatpay_rig, reason)


# -- what WeChat Pay answers of its own ---------------------------------------------------------


@pytest.mark.parametrize("code", ["NOT_ENOUGH", "USER_ACCOUNT_ABNORMAL"])
def test_a_business_refusal_is_rejected_with_wechat_pays_code(
    wechatpay_rig: Rig, code: str
) -> None:
    rig = wechatpay_rig
    rig.control.add_rule("business_reject", times=1, code=code)
    op = rig.enqueue()
    rig.executor().execute([op])
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert rig.attempts(op)[-1].detail["code"] == code
    assert rig.control.refunded("acme", "A1042") == 0 and rig.sends(op) == 1


def test_a_refund_over_what_is_left_is_refused_as_the_callers_to_fix(wechatpay_rig: Rig) -> None:
    """WeChat Pay answers ``400 INVALID_REQUEST`` (申请退款金额超过订单可退金额): not done, and
    the caller may create a corrected operation."""
    rig = wechatpay_rig
    op = rig.enqueue(params={**GOOD, "amount_minor": 999999})  # beyond the charged amount
    rig.executor().execute([op])
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "invalid_params")
    assert rig.control.refunded("acme", "A1042") == 0


def _processing(rig: Rig) -> tuple[int, Operation]:
    """An operation whose refund WeChat Pay took on and has not made (``PROCESSING``)."""
    op = rig.enqueue()
    row = rig.op(op)
    control(rig.url, "processing", {"tenant": "acme", "pattern": row.idempotency_key})
    rig.executor().execute([op])
    row = rig.op(op)
    assert row.state == "unknown" and rig.effects(op) == 0
    assert rig.executor().execute([op]) == {}  # uncertain blocks every new send
    # looked up, never sent again, while it is processing: still uncertain
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"lookup_unavailable": 1}
    assert rig.op(op).state == "unknown" and rig.op(op).lookups == 1
    assert rig.sends(op) == 1 and rig.effects(op) == 0
    rig.make_due(op)
    return op, row


@pytest.mark.parametrize(
    ("status", "state", "code"),
    [
        ("SUCCESS", "succeeded", None),
        ("CLOSED", "rejected", "refund_closed"),
        ("ABNORMAL", "rejected", "refund_abnormal"),
    ],
)
def test_a_processing_refund_settles_as_wechat_pay_ends_it(
    wechatpay_rig: Rig, status: str, state: str, code: str | None
) -> None:
    rig = wechatpay_rig
    op, row = _processing(rig)
    control(rig.url, "settle", {"tenant": "acme", "key": row.idempotency_key, "status": status})
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    settled = rig.op(op)
    assert settled.state == state
    assert settled.reason == (None if code is None else "business_rejected")
    assert rig.effects(op) == (1 if status == "SUCCESS" else 0)
    assert rig.sends(op) == 1  # settled by queries, never by a second create


BOSS = Staff.parse("bob", "supervisor")


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_refund_processing_past_the_review_time_cannot_be_resolved_until_it_settles(
    wechatpay_rig: Rig,
) -> None:
    """Staff who marked a processing refund rejected would let the app refund again, and then
    WeChat Pay completes the first: review offers nothing and refuses even a supervisor's
    override until WeChat Pay has settled it; then a requery settles it by its record."""
    rig = wechatpay_rig
    op, row = _processing(rig)
    rig.reconciler(review_after=0.001).run_once()
    (item,) = rig.reviews(op)
    queue = ReviewQueue(rig.sessions, rig.gateway(), rig.outbox.registry)
    shown = queue.show(BOSS, item.id)
    assert (shown["last_lookup"], shown["choices"]) == ("pending", [])
    for outcome in ("rejected", "succeeded"):
        with pytest.raises(ReviewConflict) as refused:
            queue.resolve(
                BOSS, item.id, outcome=outcome, version=shown["item"]["version"],
                reference="re_1", justification="the customer says it never arrived",
                override=True,
            )  # fmt: skip
        assert refused.value.code == "downstream_pending"
    assert rig.op(op).state == "unknown"
    control(rig.url, "settle", {"tenant": "acme", "key": row.idempotency_key, "status": "SUCCESS"})
    assert queue.requery(BOSS, item.id)["lookup"] == "found"
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1 and rig.sends(op) == 1


@pytest.mark.usefixtures("settled_logging")
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_no_order_amount_payee_or_key_reaches_the_log_in_wechatpay_mode(
    wechatpay_rig: Rig, level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refund, a refusal, a lost answer settled by a query and an answer whose signature
    does not verify, with Settled's logging at ``level``: no order, amount, payee or byte of
    the merchant's private key may be heard."""
    rig = wechatpay_rig
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
    assert '"logger": "workers.wechatpay_gateway"' in written.err  # the capture works
    assert rig.wechatpay is not None
    key_lines = rig.wechatpay.private_key_pem().decode().splitlines()[1:-1]
    for secret in ("A1042", "P-7", "10000", "100.00", "987654", "4321", *key_lines):
        assert secret not in text, secret


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_console_requery_of_a_refund_asks_wechat_pay_not_the_wire_protocol_service(
    wechatpay_rig: Rig, tmp_path: Path
) -> None:
    """Refunds go to WeChat Pay (``SETTLED_DOWNSTREAM_PROVIDERS``), other kinds to a wire-protocol
    service of their own (a second simulator, which never saw the refund). The console that
    ``settled web`` builds from these settings requeries a refund in review at WeChat Pay: it
    finds the refund and settles the item, asking the other service nothing."""
    rig = wechatpay_rig
    assert rig.wechatpay is not None
    op, item = in_review(rig)  # refunded at WeChat Pay, the answer lost, the query down
    key = rig.op(op).idempotency_key
    api_key = rig.tenant.api_key.get_secret_value()
    wire = start_in_thread(ledger=str(tmp_path / "wire-protocol.sqlite3"), test_mode=True)
    try:
        with SimulatorControl(wire.url) as elsewhere:
            elsewhere.add_tenant("acme", api_key)
            settings = Settings(
                database_url=rig.engine.url.render_as_string(hide_password=False),
                development=True,
                downstream_url=wire.url,
                downstream_api_keys={"acme": api_key},
                downstream_providers={"refund": "wechatpay"},
                wechatpay_merchants={"acme": rig.wechatpay},
                wechatpay_api_base=rig.url + WECHATPAY_PREFIX,
                wechatpay_order_totals="tests.support.wechatpay:order_total",
            )
            app = create_web_app(settings)
            app.dependency_overrides[current_user] = lambda: ConsoleUser(ANN, CSRF)
            app.dependency_overrides[require_csrf] = lambda: None
            with TestClient(app) as client:
                r = client.post(f"/console/review/{item}/requery", data={"csrf_token": CSRF})
                assert r.status_code == 200
                assert "The lookup found it: the operation is now succeeded." in r.text, r.text
                app.state.console.review.gateway.close()
            assert rig.op(op).state == "succeeded"
            assert rig.reviews(op)[0].resolved_by == "staff:ann"
            assert elsewhere.requests("acme", key, phase="lookup") == 0
            assert elsewhere.ledger()["requests"] == []  # nothing at all asked of it
            assert rig.effects(op) == 1 and rig.sends(op) == 1
    finally:
        wire.stop()
