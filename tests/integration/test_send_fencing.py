"""Never "not done" when it was done: every send is fenced by its lease, and a "not found" is
believed only when it proves that nothing ran.

Each test builds one interleaving on purpose (a worker delayed between its commit and its
send, a lookup answered late, a worker whose clock is off), on PostgreSQL and on SQLite,
against the simulator, whose ledger is the judge: ``rejected`` or ``cancelled`` means zero
business effects, and the report says "not sent" only when nothing was.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from outbox import runs, wire
from outbox.downstream import Accepted, DownstreamRequest, Gateway, LookupNotFound, Receipt
from outbox.models import Attempt, Operation, OperationEvent
from outbox.report import render_line
from outbox.report_lines import Group, Line
from outbox.states import State
from outbox.storage.operations import db_time
from reconciler import reconcile as reconcile_module
from tests.support.gateways import FakeMonotonic, Interposed
from tests.support.rig import GOOD, HOLD, Rig
from workers.http_client import HttpGateway

LEASE = 30.0


def line(rig: Rig, op_id: str) -> tuple[str, str]:
    """The operation's report line: its message key and its English sentence."""
    with rig.sessions() as s:
        status = runs.operation_status(s, "acme", op_id)
    shown = Line(
        op_id=status["op_id"],
        kind=status["kind"],
        state=State(status["state"]),
        group=Group(status["group"]),
        message=status["message"],
        evidence=status["evidence"],
    )
    return status["message"], render_line(shown, cancelled=False, lang="en")


def expire_lease(rig: Rig, op: int) -> None:
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))


def paused_worker(rig: Rig, op: int, during_pause: Any) -> tuple[Any, FakeMonotonic]:
    """Executor A, which claims ``op``, commits its attempt, and then stalls past its lease
    before the request leaves (a GC pause, a queue, SIGSTOP): ``during_pause`` runs then."""
    mono = FakeMonotonic()

    def pause(_key: str) -> None:
        mono.advance(LEASE + 5)  # A's own clock: the pause outlasts its lease
        expire_lease(rig, op)  # the database's view of the same pause
        during_pause()

    executor = rig.executor(lease_seconds=LEASE, monotonic=mono, worker="A")
    executor.gateway = Interposed(executor.gateway, before_submit=pause)
    return executor, mono


def requeue_after_not_found(rig: Rig, op: int) -> None:
    """The reconciler takes the abandoned operation over: lookup "not found", then (once the
    attempt is quiet) back to planned with the same key."""
    assert rig.reconciler().run_once().outcomes == {"abandoned": 1}
    rig.make_quiet(op)
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    assert rig.op(op).state == "planned"


def test_a_worker_paused_past_its_lease_sends_nothing_when_the_budget_is_then_spent(
    rig: Rig,
) -> None:
    op = rig.enqueue("op-1", max_attempts=1)

    def meanwhile() -> None:
        requeue_after_not_found(rig, op)
        rig.make_due(op)
        assert rig.executor(worker="B").execute([op]) == {op: State.REJECTED}

    worker_a, _ = paused_worker(rig, op, meanwhile)
    worker_a.execute([op])
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "not_executed")
    assert rig.effects(op) == 0
    assert rig.sends(op) == 0
    message, text = line(rig, "op-1")
    assert message == "rejected"
    # its one attempt may have reached the service (the not-found proved it had no effect)
    assert "spent without effect" in text and " sent" not in text


def test_a_worker_delayed_past_its_lease_before_sending_records_not_sent_before_the_send(
    rig: Rig,
) -> None:
    """The executor's own check, before the gateway is called: the attempt says so (phase
    ``before``), and nothing reaches the downstream."""
    op = rig.enqueue("op-1")
    mono_reads = iter([0.0])  # the reading before the claim; every later one is a lease on

    def stalled() -> float:
        return next(mono_reads, LEASE + 5)

    executor = rig.executor(lease_seconds=LEASE, monotonic=stalled, worker="A")

    def submit(request: DownstreamRequest, /, **kw: Any) -> Any:
        raise AssertionError("the gateway was called after the lease ended")

    executor.gateway = Interposed(executor.gateway)
    executor.gateway.submit = submit  # type: ignore[method-assign]
    assert executor.execute([op]) == {op: State.PLANNED}
    (attempt,) = rig.attempts(op)
    assert (attempt.proof, attempt.detail.get("phase")) == ("not_sent", "before")
    assert rig.sends(op) == 0


def test_a_worker_paused_past_its_lease_sends_nothing_after_the_run_is_cancelled(
    rig: Rig,
) -> None:
    with rig.sessions.begin() as s:
        handle = runs.open_run(s, tenant="acme").handle
    with rig.sessions.begin() as s:
        run = runs.find_run(s, "acme", handle)
        op = rig.outbox.enqueue(
            s, tenant="acme", op_id="op-9", kind="refund", params=GOOD, run=run
        ).operation.id

    def meanwhile() -> None:
        requeue_after_not_found(rig, op)
        with rig.sessions.begin() as s:
            runs.cancel_run(s, "acme", handle, actor="user")

    worker_a, _ = paused_worker(rig, op, meanwhile)
    worker_a.execute([op])
    assert rig.op(op).state == "cancelled"
    assert rig.effects(op) == 0 and rig.sends(op) == 0
    message, text = line(rig, "op-9")
    assert message == "cancelled_after_check"
    assert "before it was sent" not in text


def test_a_worker_paused_past_its_lease_never_sends_beside_the_new_owner(rig: Rig) -> None:
    op = rig.enqueue("op-1")

    def meanwhile() -> None:
        requeue_after_not_found(rig, op)
        rig.make_due(op)
        assert rig.executor(worker="B").execute([op]) == {op: State.SUCCEEDED}

    worker_a, _ = paused_worker(rig, op, meanwhile)
    worker_a.execute([op])
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1
    assert rig.sends(op) == 1  # only the new owner's request ever left
    # A's attempt is recorded as never sent, and its stale write changed nothing.
    with rig.sessions() as s:
        actors = s.scalars(
            select(OperationEvent.actor).where(
                OperationEvent.operation_id == op, OperationEvent.to_state == "succeeded"
            )
        ).all()
    assert actors == ["B"]


def test_every_send_of_a_large_hint_leaves_inside_its_lease(rig: Rig) -> None:
    """A hint of 49 ids to a downstream that takes most of the client timeout: all 49 are
    sent at once, each told a deadline inside its lease, and all succeed (before: a pool of
    16 sent them in four waves, the later ones past their lease)."""
    rig.control.add_rule("hold_before_commit", hold_seconds=1.2)
    ids = [
        rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}, max_attempts=1) for i in range(49)
    ]
    # Waves of 16 would start the fourth at 3.6 s, 0.2 s before the send bound (lease less
    # margin): it could not finish. All at once leave 1.8 s of slack for a loaded machine.
    executor = rig.executor(lease_seconds=4.0, max_batch=64, clock_margin=0.2)
    executor.gateway = rig.gateway(timeout=3.0)
    written = executor.execute(ids)
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    told = rig.control.ledger()["requests"]
    assert len(told) == 49
    with rig.sessions() as s:
        rows = s.execute(
            select(Operation.idempotency_key, Attempt.not_after).join(
                Attempt, Attempt.operation_id == Operation.id
            )
        )
        bounds = {key: not_after for key, not_after in rows}
    for row in told:
        sent_deadline = wire.parse_deadline(row["last_deadline"])
        assert sent_deadline is not None
        assert sent_deadline <= bounds[row["idempotency_key"]] - timedelta(seconds=0.2)
    assert all(rig.effects(i) == 1 for i in ids)


def test_a_hint_larger_than_the_batch_is_worked_in_batches_each_claimed_before_its_sends(
    rig: Rig,
) -> None:
    ids = [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(7)]
    executor = rig.executor(max_batch=3)
    assert executor.execute(ids) == dict.fromkeys(ids, State.SUCCEEDED)
    with rig.sessions() as s:
        versions = s.scalars(select(Attempt.lease_version).order_by(Attempt.id)).all()
    assert versions == [1] * 7
    assert all(rig.effects(i) == 1 for i in ids)


def test_a_not_found_is_dated_when_it_was_asked_not_when_the_answer_came(rig: Rig) -> None:
    """A lookup asked before quiescence and answered after it proves nothing: the send it
    raced became visible meanwhile. The operation must never be requeued and rejected."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    rig.control.set_switches(lookup_visibility_delay=3600)  # committed, not yet visible
    op = rig.enqueue("op-1", max_attempts=1)
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    assert rig.effects(op) == 1

    def answered_late(found: Any) -> None:
        assert isinstance(found, LookupNotFound)
        # While the answer travelled back: the effect became visible, and the database's
        # clock passed the attempt's quiet point.
        rig.control.set_switches(lookup_visibility_delay=0)
        with rig.sessions() as s:
            now = db_time(s)
        quiet_from = now - timedelta(seconds=2)  # + processing time (2 s) = now
        with rig.sessions.begin() as s:
            s.execute(
                update(Attempt)
                .where(Attempt.operation_id == op)
                .values(not_after=quiet_from, finished_at=quiet_from)
            )

    reconciler = rig.reconciler()
    reconciler.gateway = Interposed(reconciler.gateway, after_lookup=answered_late)
    assert reconciler.run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == "unknown"
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1


def test_a_worker_whose_clock_runs_ahead_of_the_database_still_looks_up(rig: Rig) -> None:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    ahead = HttpGateway(
        rig.url,
        {rig.tenant.name: rig.tenant.api_key},
        timeout=2.0,
        clock=lambda: datetime.now(UTC) + timedelta(seconds=15),
    )
    try:
        reconciler = rig.reconciler()
        reconciler.gateway = ahead
        assert reconciler.run_once().outcomes == {"found": 1}
    finally:
        ahead.close()
    assert rig.op(op).state == "succeeded"


def test_an_unknown_fingerprint_key_version_holds_only_that_operation(rig: Rig) -> None:
    ids = [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(3)]
    odd = ids[1]
    rig.set(odd, fingerprint_key_version="v0")  # a key version this worker no longer has
    written = rig.executor().execute(ids)
    assert written == {ids[0]: State.SUCCEEDED, odd: State.PLANNED, ids[2]: State.SUCCEEDED}
    row = rig.op(odd)
    assert (row.state, row.lease_owner, row.attempts) == ("planned", None, 0)
    assert row.next_attempt_at > datetime.now(UTC) + timedelta(seconds=30)
    assert rig.sends(odd) == 0
    with rig.sessions() as s:
        reasons = s.scalars(
            select(OperationEvent.reason)
            .where(OperationEvent.operation_id == odd)
            .order_by(OperationEvent.id)
        ).all()
    assert reasons[-1] == "fingerprint_key_unknown"


class Poisoned:
    """The downstream answers one key with a receipt whose reference the database refuses
    (longer than its column): the gateway's own check is bypassed on purpose."""

    def __init__(self, inner: Gateway, key: str) -> None:
        self.inner, self.key = inner, key

    def submit(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        outcome = self.inner.submit(request, **kw)
        if request.idempotency_key == self.key and isinstance(outcome, Accepted):
            r = outcome.receipt
            return Accepted(Receipt("r" * 250, r.status, r.params, r.raw))
        return outcome

    def lookup(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        found = self.inner.lookup(request, **kw)
        if request.idempotency_key == self.key and hasattr(found, "receipt"):
            r = found.receipt
            return type(found)(Receipt("r" * 250, r.status, r.params, r.raw))
        return found


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_an_outcome_the_database_refuses_costs_only_that_operation(rig: Rig) -> None:
    ids = [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(3)]
    odd = ids[1]
    executor = rig.executor()
    executor.gateway = Poisoned(executor.gateway, rig.op(odd).idempotency_key)
    written = executor.execute(ids)
    assert written == {ids[0]: State.SUCCEEDED, odd: State.UNKNOWN, ids[2]: State.SUCCEEDED}
    assert [r.reason for r in rig.reviews(odd)] == ["outcome_not_recorded"]
    assert rig.attempts(odd)[0].proof == "done"
    assert all(rig.effects(i) == 1 for i in ids)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_one_operation_the_database_refuses_never_aborts_a_reconcile_pass(rig: Rig) -> None:
    rig.control.add_rule("commit_then_timeout", times=2, hold_seconds=HOLD)
    ids = [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(2)]
    rig.executor().execute(ids)
    assert {rig.op(i).state for i in ids} == {"unknown"}
    odd = ids[0]
    reconciler = rig.reconciler()
    reconciler.gateway = Poisoned(reconciler.gateway, rig.op(odd).idempotency_key)
    assert reconciler.run_once().outcomes == {"error": 1, "found": 1}
    assert rig.op(ids[1]).state == "succeeded"
    assert rig.op(odd).state == "unknown"
    assert [r.reason for r in rig.reviews(odd)] == ["reconcile_failed"]
    # The next pass goes on as usual (it used to die on the same row every time).
    rig.make_due(odd)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(odd).state == "succeeded"
    assert rig.reviews(odd)[0].resolved_at is not None


def test_a_database_blip_during_a_reconcile_puts_nobody_in_review(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection is lost after the lookup (PostgreSQL restarting): the operation is not
    the staff's case; its lease lapses and the next pass settles it."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    real = reconcile_module.operation_facts
    lost = OperationalError("SELECT", {}, Exception("server closed the connection"))

    def facts_once(*args: Any, **kw: Any) -> Any:
        monkeypatch.setattr(reconcile_module, "operation_facts", real)
        raise lost

    monkeypatch.setattr(reconcile_module, "operation_facts", facts_once)
    assert rig.reconciler().run_once().outcomes == {"deferred": 1}
    row = rig.op(op)
    assert (row.state, rig.reviews(op)) == ("unknown", [])
    assert row.lease_owner is not None  # kept: it lapses, and nobody wrote a verdict
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded" and rig.reviews(op) == []


def poll(condition: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("condition never held")
        time.sleep(0.02)  # polling a condition, with a deadline


def test_no_resend_inside_the_retention_margin_when_the_downstream_clock_runs_ahead(
    rig: Rig,
) -> None:
    """Scaled down: keys kept 5 s, margin 1 s, the downstream's clock 0.3 s ahead. At 4.8 s
    the downstream has forgotten the key and answers "not found"; resending then would
    refund twice. The margin sends it to review instead."""
    registry = rig.outbox.registry.with_contract(
        "refund", key_retention=timedelta(seconds=5), retention_margin=timedelta(seconds=1)
    )
    rig.control.set_switches(key_retention_seconds=5)
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    assert (rig.op(op).state, rig.effects(op)) == ("unknown", 1)
    # 4.8 s later by the database's clock; 5.1 s later by the downstream's.
    rig.set(op, first_sent_at=datetime.now(UTC) - timedelta(seconds=4.8))
    rig.age_attempts(op, 4.8)
    rig.control.advance_clock(5.1)
    assert rig.reconciler(registry).run_once().outcomes == {"to_review": 1}
    assert [r.reason for r in rig.reviews(op)] == ["past_key_retention"]
    rig.make_due(op)
    assert rig.executor(registry).execute([op]) == {}  # unknown: nothing to send
    assert rig.effects(op) == 1 and rig.sends(op) == 1


class Broken:
    """A downstream client with a bug: every lookup raises."""

    def submit(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        raise AssertionError("the reconciler never sends")

    def lookup(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        raise RuntimeError("a bug in the lookup")


def test_a_failed_look_at_an_abandoned_send_leaves_it_to_a_later_pass(rig: Rig) -> None:
    op = rig.enqueue()

    def die(_key: str) -> None:
        raise RuntimeError("worker lost between its commit and its send")

    executor = rig.executor()
    executor.gateway = Interposed(executor.gateway, before_submit=die)
    with pytest.raises(RuntimeError):
        executor.execute([op])
    expire_lease(rig, op)
    broken = rig.reconciler()
    broken.gateway = Broken()
    assert broken.run_once().outcomes == {"error": 1}
    row = rig.op(op)
    assert (row.state, row.lease_until is not None) == ("submitted", True)  # still leased
    expire_lease(rig, op)
    assert rig.reconciler().run_once().outcomes == {"abandoned": 1}
    assert rig.reconciler().run_once().outcomes == {"wait_quiescence": 1}
    assert rig.sends(op) == 0
