"""A same-key resend settles an unknown operation without waiting out quiescence: the
reconciler asks, and where a "not found" cannot prove anything yet it hands the operation to
the executor, which sends it again with its stored key under the reconciler's claim (against
the simulator, PostgreSQL and SQLite; the simulator's ledger counts every effect).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select

from outbox.kinds import default_registry
from outbox.models import OperationEvent, Run
from reconciler.reconcile import Reconciler
from tests.support.gateways import Interposed
from tests.support.rig import GOOD, Rig


def resending(rig: Rig, **kw: Any) -> Reconciler:
    """A reconciler that can hand a send to an executor of its own, as the runtime builds it."""
    return rig.reconciler(resender=rig.executor(worker="w2"), **kw)


def lost_before_execution(rig: Rig) -> int:
    """An operation whose request was reset before the downstream did anything: unknown,
    and a lookup finds nothing, long before that "not found" proves anything."""
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    return op


def moves(rig: Rig, op: int) -> list[tuple[str | None, str]]:
    with rig.sessions() as s:
        rows = s.scalars(
            select(OperationEvent)
            .where(OperationEvent.operation_id == op)
            .order_by(OperationEvent.id)
        )
        return [(e.from_state, e.to_state) for e in rows if e.from_state != e.to_state]


def test_an_unknown_send_is_settled_by_a_same_key_resend_before_quiescence(rig: Rig) -> None:
    op = lost_before_execution(rig)
    key = rig.op(op).idempotency_key
    report = resending(rig).run_once()
    assert report.outcomes == {"resent": 1}
    row = rig.op(op)
    assert row.state == "succeeded" and row.idempotency_key == key
    assert row.attempts == 2 and row.lookups == 1
    assert rig.effects(op) == 1 and rig.sends(op) == 2
    assert moves(rig, op)[-2:] == [("unknown", "submitted"), ("submitted", "succeeded")]


def test_a_resend_of_a_request_that_was_carried_out_replays_its_answer_once(rig: Rig) -> None:
    """The first request was carried out, its answer lost, and the downstream's lookup does not
    show it yet: the resend gets the replay of the key, and the refund is made once."""
    rig.control.add_rule("commit_then_reset", times=1)
    rig.control.set_switches(lookup_visibility_delay=3600)  # done, not visible yet
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown" and rig.effects(op) == 1
    assert resending(rig).run_once().outcomes == {"resent": 1}
    row = rig.op(op)
    assert row.state == "succeeded" and row.receipt is not None
    assert row.downstream_ref == row.receipt["reference"]  # the replay's receipt, the one refund's
    assert rig.effects(op) == 1 and rig.sends(op) == 2


def test_a_replay_unlike_the_intent_goes_to_review_and_is_never_success(rig: Rig) -> None:
    op = lost_before_execution(rig)
    rig.control.add_rule("mismatched_receipt", times=1)
    assert resending(rig).run_once().outcomes == {"resent": 1}
    row = rig.op(op)
    assert row.state == "unknown"
    assert [r.reason for r in rig.reviews(op)] == ["receipt_mismatch"]


def test_a_business_refusal_of_the_resend_is_the_downstreams_answer_for_the_key(
    rig: Rig,
) -> None:
    """Applied as the key's record once no other request of the operation can land: "not
    done" waits for quiescence, however fast "done" comes."""
    op = lost_before_execution(rig)
    rig.control.add_rule("business_reject", times=1)
    assert resending(rig).run_once().outcomes == {"resent": 1}
    assert rig.op(op).state == "unknown"  # looked up at once
    assert resending(rig).run_once().outcomes == {"wait_quiescence": 1}
    rig.make_quiet(op)
    rig.set(op, next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))  # its look is due
    assert resending(rig).run_once().outcomes == {"found": 1}
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert rig.effects(op) == 0 and rig.sends(op) == 2


def test_a_resend_that_did_not_execute_stays_unknown_and_waits_out_retry_after(
    rig: Rig,
) -> None:
    """A 429 to the resend proves nothing about the first request: never "not done"."""
    op = lost_before_execution(rig)
    rig.control.add_rule("429", times=1, retry_after="30")
    before = datetime.now(UTC)
    assert resending(rig).run_once().outcomes == {"resent": 1}
    row = rig.op(op)
    assert row.state == "unknown" and row.reason is None
    assert row.next_attempt_at >= before + timedelta(seconds=29)
    assert rig.reconciler().run_once().claimed == 0  # not looked at before Retry-After


def test_refused_credentials_on_a_resend_leave_it_unknown(rig: Rig) -> None:
    op = lost_before_execution(rig)
    rig.control.add_rule("403", times=1)
    assert resending(rig).run_once().outcomes == {"resent": 1}
    assert rig.op(op).state == "unknown" and rig.effects(op) == 0


def test_no_resend_once_its_runs_cancel_was_asked_for(rig: Rig) -> None:
    rig.control.add_rule("reset_before", times=1)
    with rig.sessions.begin() as s:
        run = Run(tenant="acme", handle="run-handle-1")
        s.add(run)
        s.flush()
        op = rig.outbox.enqueue(
            s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run
        ).operation.id
    rig.executor().execute([op])
    with rig.sessions.begin() as s:
        got = s.get(Run, run.id)
        assert got is not None
        got.cancel_requested_at = datetime.now(UTC)
    assert resending(rig).run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == "unknown" and rig.sends(op) == 1


def test_no_resend_past_the_operations_deadline(rig: Rig) -> None:
    op = lost_before_execution(rig)
    rig.set(op, deadline=datetime.now(UTC) - timedelta(seconds=1))
    report = resending(rig).run_once()
    assert "resent" not in report.outcomes
    assert rig.op(op).state == "unknown" and rig.sends(op) == 1


def test_no_resend_past_the_key_retention_less_its_margin(rig: Rig) -> None:
    """The first send was 23.5 hours ago (retention 24 h, margin 1 h): the key may be
    forgotten before the resend lands, so it is not sent, however recent the last attempt."""
    op = lost_before_execution(rig)
    rig.set(
        op,
        first_sent_at=datetime.now(UTC) - timedelta(hours=23.5),
        deadline=datetime.now(UTC) + timedelta(hours=48),
    )
    assert resending(rig).run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == "unknown" and rig.sends(op) == 1


def test_no_resend_once_the_attempt_budget_is_spent(rig: Rig) -> None:
    op = lost_before_execution(rig)
    rig.set(op, max_attempts=1)
    assert resending(rig).run_once().outcomes == {"wait_quiescence": 1}
    assert rig.sends(op) == 1
    assert rig.op(op).lookups == 1  # the lookup before the resend that was not sent


def test_no_automatic_resend_without_idempotency(rig: Rig) -> None:
    registry = default_registry().with_contract("refund", idempotent=False)
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    report = rig.reconciler(registry, resender=rig.executor(registry, worker="w2")).run_once()
    assert "resent" not in report.outcomes
    assert rig.sends(op) == 1 and rig.op(op).state == "unknown"


def test_a_stale_reconciler_claim_sends_nothing(rig: Rig) -> None:
    """The resend is fenced by the reconciler's claim: once another has claimed the
    operation, the attempt's start is refused and nothing leaves."""
    op = lost_before_execution(rig)
    executor = rig.executor(worker="w2")
    reconciler = rig.reconciler(resender=executor)
    taken: list[int] = []

    def resend_after_takeover(claimed: Any, kind: Any, clock: Any, *, looked: bool) -> Any:
        rig.set(op, lease_version=claimed.lease_version + 1)  # a newer claim took it
        taken.append(op)
        return executor.resend(claimed, kind, clock, looked=looked)

    reconciler.resender = type("Late", (), {"resend": staticmethod(resend_after_takeover)})()
    reconciler.run_once()
    assert taken == [op]
    assert rig.sends(op) == 1 and rig.op(op).state == "unknown"


def test_no_resend_once_the_reconcilers_lease_could_not_be_renewed(rig: Rig) -> None:
    """After the lookup the database would not renew the reconciler's lease (it lapsed): the
    operation is no longer surely its own to send, so nothing is sent, and it is decided as by
    a reconciler that cannot resend."""
    op = lost_before_execution(rig)
    reconciler = resending(rig)

    def lapsed(found: Any) -> None:
        rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
        assert reconciler.keeper.renew_now() == set()

    reconciler.gateway = Interposed(reconciler.gateway, after_lookup=lapsed)
    assert reconciler.run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == "unknown" and rig.sends(op) == 1
