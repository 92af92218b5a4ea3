"""The executor against the simulator over HTTP and a real database (PostgreSQL and SQLite).

Every test reads the simulator's ledger, not only our rows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.downstream import DownstreamRequest
from outbox.errors import StaleLease
from outbox.kinds import default_registry
from outbox.models import Attempt, Operation, OperationEvent, Run
from outbox.states import Event, State
from outbox.storage.transitions import Transition
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.simtools import CLIENT_TIMEOUT
from workers.executor import Executor


def test_happy_path_records_the_receipt(rig: Rig) -> None:
    op_id = rig.enqueue()
    assert rig.executor().execute([op_id]) == {op_id: State.SUCCEEDED}
    op = rig.op(op_id)
    assert op.state == "succeeded" and op.attempts == 1
    assert op.receipt is not None and op.receipt["params"]["amount_minor"] == 10000
    assert op.downstream_ref == op.receipt["reference"]
    assert [a.proof for a in rig.attempts(op_id)] == ["done"]
    assert rig.effects(op_id) == 1
    assert rig.control.refunded("acme", "A1042") == 10000
    with rig.sessions() as s:
        events = s.execute(
            select(OperationEvent.from_state, OperationEvent.to_state)
            .where(OperationEvent.operation_id == op_id)
            .order_by(OperationEvent.id)
        ).all()
    assert [tuple(e) for e in events] == [
        (None, "planned"),
        ("planned", "submitted"),
        ("submitted", "succeeded"),
    ]


def test_one_hint_delivered_five_times_sends_once(rig: Rig) -> None:
    op_id = rig.enqueue()
    executor = rig.executor()
    results = [executor.execute([op_id]) for _ in range(5)]
    assert results[0] == {op_id: State.SUCCEEDED}
    assert results[1:] == [{}] * 4
    assert rig.sends(op_id) == 1
    assert rig.effects(op_id) == 1


def test_commit_then_timeout_marks_unknown_with_one_effect(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD)
    rig.executor().execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.attempts) == ("unknown", 1)
    assert op.unknown_since is not None
    assert [a.proof for a in rig.attempts(op_id)] == ["unknown"]
    assert rig.effects(op_id) == 1
    # Unknown blocks any new send: a later hint claims nothing.
    assert rig.executor().execute([op_id]) == {}
    assert rig.sends(op_id) == 1


def test_commit_then_reset_marks_unknown(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("commit_then_reset")
    rig.executor().execute([op_id])
    assert rig.op(op_id).state == "unknown"
    assert rig.effects(op_id) == 1


def test_reset_before_processing_is_still_unknown_to_us(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("reset_before")
    rig.executor().execute([op_id])
    assert rig.op(op_id).state == "unknown"
    assert rig.effects(op_id) == 0


def test_503_after_commit_is_unknown_under_the_default_contract(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("503_after_commit")
    rig.executor().execute([op_id])
    assert rig.op(op_id).state == "unknown"
    assert rig.effects(op_id) == 1


def test_503_documented_as_before_processing_is_retried_with_the_same_key(rig: Rig) -> None:
    registry = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    op_id = rig.enqueue()
    rig.control.add_rule("503_before", times=1)
    executor = rig.executor(registry)
    assert executor.execute([op_id]) == {op_id: State.PLANNED}
    op = rig.op(op_id)
    assert (op.state, op.attempts) == ("planned", 1)
    key = op.idempotency_key
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.SUCCEEDED}
    assert rig.op(op_id).idempotency_key == key
    assert [a.proof for a in rig.attempts(op_id)] == ["not_executed", "done"]
    assert rig.effects(op_id) == 1


def test_429_retry_after_inside_the_deadline_schedules_the_retry(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("429", retry_after="30", times=1)
    before = datetime.now(UTC)
    rig.executor().execute([op_id])
    op = rig.op(op_id)
    assert op.state == "planned"
    assert timedelta(seconds=29) < op.next_attempt_at - before < timedelta(seconds=32)
    # Not due yet: a hint claims nothing and sends nothing.
    assert rig.executor().execute([op_id]) == {}
    assert rig.sends(op_id) == 1  # the 429 itself; no second request
    assert rig.effects(op_id) == 0


def test_retry_after_beyond_the_deadline_stops_at_once(rig: Rig) -> None:
    op_id = rig.enqueue(deadline=datetime.now(UTC) + timedelta(seconds=20))
    rig.control.add_rule("429", retry_after="3600")
    rig.executor().execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.reason, op.attempts) == ("rejected", "not_executed", 1)
    assert rig.effects(op_id) == 0


def test_persistent_503_never_exceeds_max_attempts(rig: Rig) -> None:
    registry = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    op_id = rig.enqueue(max_attempts=3)
    rig.control.add_rule("503_before")
    executor = rig.executor(registry)
    for _ in range(10):  # more hints than the budget allows
        rig.make_due(op_id)
        executor.execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.reason, op.attempts) == ("rejected", "not_executed", 3)
    assert len(rig.attempts(op_id)) == 3
    assert rig.effects(op_id) == 0


def test_connection_refused_is_not_sent_and_retried(rig: Rig, engine: Engine) -> None:
    op_id = rig.enqueue()
    dead = rig.gateway("http://127.0.0.1:9", timeout=CLIENT_TIMEOUT)
    executor = Executor(
        sessions=rig.sessions,
        gateway=dead,
        registry=rig.outbox.registry,
        fingerprinter=rig.outbox.fingerprinter,
        worker="w1",
        rand=lambda: 0.0,
    )
    assert executor.execute([op_id]) == {op_id: State.PLANNED}
    assert [a.proof for a in rig.attempts(op_id)] == ["not_sent"]
    rig.make_due(op_id)
    assert rig.executor().execute([op_id]) == {op_id: State.SUCCEEDED}
    assert rig.effects(op_id) == 1


def test_business_refusal_is_rejected_with_reason(rig: Rig) -> None:
    op_id = rig.enqueue(params={**GOOD, "amount_minor": 999999})  # beyond the charged amount
    rig.executor().execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.reason) == ("rejected", "business_rejected")
    assert rig.control.refunded("acme", "A1042") == 0


def test_wrong_api_key_is_permission_denied_and_never_retried(rig: Rig) -> None:
    op_id = rig.enqueue()
    gateway = rig.gateway(api_keys={"acme": SecretStr("sk_wrong")}, timeout=CLIENT_TIMEOUT)
    executor = Executor(
        sessions=rig.sessions,
        gateway=gateway,
        registry=rig.outbox.registry,
        fingerprinter=rig.outbox.fingerprinter,
        worker="w1",
    )
    executor.execute([op_id])
    assert (rig.op(op_id).state, rig.op(op_id).reason) == ("rejected", "permission_denied")


def test_403_permission_error_is_permission_denied_and_never_retried(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("403")  # every request: a retry would be refused again, and counted
    assert rig.executor().execute([op_id]) == {op_id: State.REJECTED}
    assert (rig.op(op_id).state, rig.op(op_id).reason) == ("rejected", "permission_denied")
    rig.make_due(op_id)
    assert rig.executor().execute([op_id]) == {}  # terminal: nothing claims it again
    assert rig.sends(op_id) == 1 and rig.effects(op_id) == 0
    assert rig.reviews(op_id) == []


def test_mismatched_receipt_is_unknown_with_a_review_item(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.control.add_rule("mismatched_receipt")
    rig.executor().execute([op_id])
    assert rig.op(op_id).state == "unknown"
    assert [r.reason for r in rig.reviews(op_id)] == ["receipt_mismatch"]


def test_without_idempotency_a_refused_first_send_is_the_only_send(rig: Rig) -> None:
    registry = default_registry().with_contract("refund", idempotent=False)
    op_id = rig.enqueue()
    rig.control.add_rule("429", retry_after="1")
    rig.executor(registry).execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.reason) == ("rejected", "not_executed")
    assert rig.executor(registry).execute([op_id]) == {}


def test_ambiguous_send_without_idempotency_or_lookup_goes_to_review(rig: Rig) -> None:
    registry = default_registry().with_contract("refund", idempotent=False, queryable=False)
    op_id = rig.enqueue()
    rig.control.add_rule("commit_then_reset")
    rig.executor(registry).execute([op_id])
    assert rig.op(op_id).state == "unknown"
    assert [r.reason for r in rig.reviews(op_id)] == ["ambiguous_without_idempotency_or_lookup"]
    assert rig.effects(op_id) == 1


def test_cancelled_run_is_not_sent(rig: Rig) -> None:
    with rig.sessions.begin() as s:
        run = Run(tenant="acme", handle="run-handle-1")
        s.add(run)
        s.flush()
        op_id = rig.outbox.enqueue(
            s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run
        ).operation.id
        run.cancel_requested_at = datetime.now(UTC)
    assert rig.executor().execute([op_id]) == {op_id: State.CANCELLED}
    assert rig.sends(op_id) == 0


def test_params_changed_after_intake_are_never_sent(rig: Rig) -> None:
    op_id = rig.enqueue()
    with rig.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == op_id)
            .values(params={**GOOD, "amount_minor": 99})
        )
    rig.executor().execute([op_id])
    op = rig.op(op_id)
    assert (op.state, op.reason) == ("rejected", "not_executed")
    assert rig.sends(op_id) == 0


def test_past_the_deadline_nothing_is_sent(rig: Rig) -> None:
    op_id = rig.enqueue(deadline=datetime.now(UTC) + timedelta(seconds=30))
    with rig.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == op_id)
            .values(deadline=datetime.now(UTC) - timedelta(seconds=1))
        )
    rig.executor().execute([op_id])
    assert (rig.op(op_id).state, rig.op(op_id).reason) == ("rejected", "not_executed")
    assert rig.sends(op_id) == 0


def test_past_key_retention_nothing_is_sent(rig: Rig) -> None:
    op_id = rig.enqueue()
    with rig.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == op_id)
            .values(
                first_sent_at=datetime.now(UTC) - timedelta(hours=25),
                deadline=datetime.now(UTC) + timedelta(hours=30),
            )
        )
    rig.executor().execute([op_id])
    assert (rig.op(op_id).state, rig.op(op_id).reason) == ("rejected", "not_executed")
    assert rig.sends(op_id) == 0


def expire_lease(sessions: sessionmaker[Session], op_id: int) -> None:
    with sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == op_id)
            .values(lease_until=datetime.now(UTC) - timedelta(seconds=1))
        )


def test_a_stale_worker_cannot_overwrite_the_newer_claim(rig: Rig) -> None:
    op_id = rig.enqueue()
    old = rig.start_send(op_id, worker="old")
    expire_lease(rig.sessions, op_id)  # the old worker is paused past its lease
    new = rig.claim(op_id, worker="new")
    assert new.lease_version == old.lease_version + 1
    with rig.sessions.begin() as s:
        rig.storage.write_transition(s, Transition(new, Event.LOSE, State.UNKNOWN), actor="new")
    with rig.sessions.begin() as s, pytest.raises(StaleLease):
        rig.storage.write_transition(s, Transition(old, Event.ACCEPT, State.SUCCEEDED), actor="old")
    assert rig.op(op_id).state == "unknown"


def test_abandoned_send_is_queried_never_resent(rig: Rig) -> None:
    op_id = rig.enqueue()
    key = rig.op(op_id).idempotency_key
    # A worker claimed and sent, then died before recording the outcome.
    rig.start_send(op_id)
    gateway = rig.gateway(timeout=CLIENT_TIMEOUT)
    from outbox.kinds import default_registry as reg

    gateway.submit(
        DownstreamRequest("acme", rig.op(op_id).op_id, reg().get("refund"), key, GOOD),
        deadline=datetime.now(UTC) + timedelta(seconds=5),
    )
    assert rig.executor().execute([op_id]) == {}  # lease still live: nothing to claim
    expire_lease(rig.sessions, op_id)
    assert rig.executor().execute([op_id]) == {op_id: State.SUCCEEDED}
    assert rig.sends(op_id) == 1
    assert rig.effects(op_id) == 1
    assert rig.control.requests("acme", key, phase="lookup") == 1


def test_abandoned_send_not_found_becomes_unknown(rig: Rig) -> None:
    op_id = rig.enqueue()
    rig.start_send(op_id)
    expire_lease(rig.sessions, op_id)
    assert rig.executor().execute([op_id]) == {op_id: State.UNKNOWN}
    assert rig.sends(op_id) == 0


def test_batch_claim_sends_other_due_operations_concurrently(rig: Rig) -> None:
    ids = [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(6)]
    written = rig.executor(batch_extra=5).execute([ids[0]])
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    assert all(rig.effects(i) == 1 for i in ids)
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Attempt)) == 6


class _Raising:
    """A gateway whose submit of one key raises (a bug in an adapter): the others answer."""

    def __init__(self, inner: object, key: str) -> None:
        self.inner, self.key = inner, key

    def submit(self, request: DownstreamRequest, /, **kw: object) -> object:
        if request.idempotency_key == self.key:
            raise RuntimeError("the adapter failed")
        return self.inner.submit(request, **kw)  # type: ignore[attr-defined]

    def lookup(self, request: DownstreamRequest, /, **kw: object) -> object:
        return self.inner.lookup(request, **kw)  # type: ignore[attr-defined]


def test_a_send_that_raises_in_a_batch_is_raised_after_the_others_are_written(rig: Rig) -> None:
    """A gateway returns values; one that raises is a bug, and it must not pass silently: the
    batch's other outcomes are written, the failed one is left ``submitted`` for the
    reconciler to look up (it may have been sent), and the error is raised after."""
    ids = [rig.enqueue(f"op-{n}", {**GOOD, "amount_minor": 100 + n}) for n in range(3)]
    broken = ids[1]
    executor = rig.executor(batch_extra=2)
    executor.gateway = _Raising(rig.gateway(), rig.op(broken).idempotency_key)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="the adapter failed"):
        executor.execute([ids[0]])
    assert [rig.op(i).state for i in ids] == ["succeeded", "submitted", "succeeded"]
    assert rig.effects(broken) == 0
