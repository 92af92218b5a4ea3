"""The reconciler against the simulator and a real database (PostgreSQL and SQLite).

Every operation ends succeeded, rejected or in review with evidence; the simulator's ledger
confirms each settled one.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

from outbox import runs
from outbox.clock import Deadline
from outbox.db import db_now
from outbox.downstream import DownstreamRequest, LookupOutcome
from outbox.downstream_clock import Episode
from outbox.kinds import default_registry
from outbox.models import ClockStep, DownstreamClockLag, Operation, OperationEvent, Run
from outbox.states import State
from outbox.storage.downstream_clock import record_lag
from outbox.storage.operations import db_time
from reconciler import reconcile
from reconciler.reconcile import PassReport, Reconciler
from settled.simulator.proxy import FaultProxy
from tests.support.contend import contender, pausing
from tests.support.gateways import FakeMonotonic, SlowLookups
from tests.support.rig import HOLD, Rig


def lost_after_commit(rig: Rig) -> int:
    """An operation whose response was lost after the downstream committed it."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    return op


def test_commit_then_timeout_is_reconciled_to_succeeded_with_one_effect(rig: Rig) -> None:
    op = lost_after_commit(rig)
    report = rig.reconciler().run_once()
    assert report.outcomes == {"found": 1}
    row = rig.op(op)
    assert row.state == "succeeded"
    assert row.receipt is not None and row.downstream_ref == row.receipt["reference"]
    assert row.lookups == 1
    assert rig.effects(op) == 1
    assert rig.sends(op) == 1
    assert rig.reviews(op) == []


def test_a_pass_claims_its_batch_a_chunk_at_a_time_and_stops_there(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Six operations due, a batch of five, chunks of three: the pass claims three, then the
    two its batch has left, and ends with its batch full (it never asks for a claim of
    nothing); the next pass takes the sixth, and stops at a chunk that was not filled."""
    ops = done_but_unknown(rig, 6)
    limits: list[int] = []
    claim = reconcile.claim_unresolved

    def counted(session: Any, *, limit: int, **kw: Any) -> Any:
        limits.append(limit)
        assert limit > 0 and len(limits) <= 4, f"a claim of {limit}, call {len(limits)}"
        return claim(session, limit=limit, **kw)

    monkeypatch.setattr(reconcile, "claim_unresolved", counted)
    reconciler = rig.reconciler(batch=5, client_timeout=10.0)
    assert reconciler.chunk == 3  # 4 leases of 15 s, twice a 10 s lookup each
    with caplog.at_level(logging.INFO, logger="reconciler.reconcile"):
        first = reconciler.run_once()
    (logged,) = [r for r in caplog.records if r.getMessage() == "reconcile pass"]
    assert (logged.claimed, logged.outcomes) == (5, {"found": 5})  # type: ignore[attr-defined]
    assert (first.claimed, first.outcomes, limits) == (5, {"found": 5}, [3, 2])
    assert first.as_dict() == {
        "claimed": 5,
        "outcomes": {"found": 5},
        "oldest_unknown_seconds": first.oldest_unknown_seconds,
        "at": first.at.isoformat(),
    }
    assert first.oldest_unknown_seconds is not None  # the sixth, still unknown
    assert 699 < first.oldest_unknown_seconds < 900
    second = reconciler.run_once()
    assert (second.claimed, second.outcomes, limits) == (1, {"found": 1}, [3, 2, 3])
    assert json.loads(json.dumps(second.as_dict())) == {  # as `settled reconcile --once` prints
        "claimed": 1,
        "outcomes": {"found": 1},
        "oldest_unknown_seconds": None,
        "at": second.at.isoformat(),
    }
    assert {rig.op(o).state for o in ops} == {"succeeded"}


def test_a_commit_between_the_reconcilers_read_and_its_write_does_not_defer_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass reads the operation's facts, then writes what the lookup found; the app
    commits in between. On SQLite the write failed ("database is locked", the busy timeout
    never applied) and the operation was left for a later pass."""
    op = lost_after_commit(rig)

    def open_run() -> int:
        with rig.sessions.begin() as s:
            return runs.open_run(s, tenant="acme").id

    with contender(open_run) as app:
        pausing(monkeypatch, reconcile, "operation_facts", app, after=True)
        report = rig.reconciler().run_once()
        run_id = app.result()
    assert report.outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded" and rig.effects(op) == 1
    with rig.sessions() as s:
        assert s.get(Run, run_id) is not None


def test_business_refusal_found_by_lookup_is_rejected_with_the_receipt(rig: Rig) -> None:
    rig.control.add_rule("commit_then_reset", times=1)
    op = rig.enqueue(params={"order_id": "A1042", "amount_minor": 10**9, "currency": "CNY",
                             "payee": "P-7"})  # fmt: skip
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    rig.reconciler().run_once()
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert row.receipt is not None and row.receipt["status"] == "rejected"
    assert rig.control.refunded("acme", "A1042") == 0


def test_lookup_unavailable_past_the_threshold_goes_to_review_and_stays_unknown(
    rig: Rig,
) -> None:
    op = lost_after_commit(rig)
    rig.control.add_rule("lookup_unavailable")
    reconciler = rig.reconciler(review_after=600)
    assert reconciler.run_once().outcomes == {"lookup_unavailable": 1}
    assert rig.reviews(op) == []
    # Time passes (moved in the database, not slept): unknown for longer than the threshold.
    rig.set(
        op,
        unknown_since=datetime.now(UTC) - timedelta(seconds=700),
        next_attempt_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert reconciler.run_once().outcomes == {"to_review": 1}
    row = rig.op(op)
    assert row.state == "unknown"
    (item,) = rig.reviews(op)
    assert item.reason == "lookup_unavailable"
    assert item.evidence["lookups"] == 2
    assert [a["proof"] for a in item.evidence["attempts"]] == ["unknown"]
    assert rig.effects(op) == 1  # it did happen; nobody claims otherwise


def test_idempotency_off_and_ambiguous_send_goes_to_review_without_a_second_send(
    rig: Rig,
) -> None:
    registry = default_registry().with_contract("refund", idempotent=False)
    rig.control.set_switches(idempotency=False)
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    assert rig.op(op).state == "unknown"
    rig.age_attempts(op, 3600)  # long quiet: with idempotency a resend would be allowed now
    report = rig.reconciler(registry).run_once()
    assert report.outcomes == {"to_review": 1}
    assert [r.reason for r in rig.reviews(op)] == ["ambiguous_without_idempotency"]
    assert rig.op(op).state == "unknown"
    rig.executor(registry).execute([op])
    assert rig.sends(op) == 1
    assert rig.effects(op) == 0


def test_idempotency_off_but_found_by_lookup_is_settled_from_the_receipt(rig: Rig) -> None:
    registry = default_registry().with_contract("refund", idempotent=False)
    rig.control.set_switches(idempotency=False)
    rig.control.add_rule("commit_then_reset", times=1)
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    assert rig.reconciler(registry).run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.sends(op) == 1
    assert rig.effects(op) == 1


def test_not_found_inside_quiescence_takes_no_action(rig: Rig) -> None:
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    before = rig.op(op)
    assert before.state == "unknown"
    report = rig.reconciler().run_once()
    assert report.outcomes == {"wait_quiescence": 1}
    after = rig.op(op)
    assert after.state == "unknown"
    assert after.next_attempt_at > datetime.now(UTC)  # looks again once quiet
    assert rig.sends(op) == 1
    # Not due yet: the next pass does not even look.
    assert rig.reconciler().run_once().claimed == 0


def test_not_found_after_quiescence_is_sent_again_with_the_same_key(rig: Rig) -> None:
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    key = rig.op(op).idempotency_key
    rig.executor().execute([op])
    rig.make_quiet(op)  # quiet for longer than client timeout + processing time
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    assert rig.op(op).state == "planned"
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.op(op).idempotency_key == key
    assert rig.effects(op) == 1


def test_past_key_retention_nothing_is_sent_again(rig: Rig) -> None:
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    rig.age_attempts(op, 25 * 3600)
    rig.set(
        op,
        first_sent_at=datetime.now(UTC) - timedelta(hours=25),
        deadline=datetime.now(UTC) + timedelta(hours=48),
    )
    assert rig.reconciler().run_once().outcomes == {"to_review": 1}
    assert [r.reason for r in rig.reviews(op)] == ["past_key_retention"]
    assert rig.op(op).state == "unknown"
    assert rig.sends(op) == 1


def test_mismatched_lookup_stays_in_review(rig: Rig) -> None:
    rig.control.add_rule("mismatched_receipt")
    op = rig.enqueue()
    rig.executor().execute([op])
    assert [r.reason for r in rig.reviews(op)] == ["receipt_mismatch"]
    report = rig.reconciler().run_once()
    assert report.outcomes == {"in_review": 1}
    assert rig.op(op).state == "unknown"
    assert len(rig.reviews(op)) == 1


def test_worker_died_mid_send_is_found_by_the_reconciler(rig: Rig) -> None:
    op = rig.enqueue()
    rig.sent_by_a_dead_worker(op)
    assert rig.reconciler().run_once().claimed == 0  # the lease is still live
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1


def test_found_later_closes_the_open_review_item(rig: Rig) -> None:
    op = lost_after_commit(rig)
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    rig.reconciler().run_once()
    (item,) = rig.reviews(op)
    assert item.resolved_at is None
    rig.set(op, next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    (item,) = rig.reviews(op)
    assert item.resolved_at is not None
    assert item.resolution == {
        "state": "succeeded",
        "by": "reconciler:r1",
        "settled_with_operation": True,
    }


def test_two_reconcilers_at_once_resolve_each_operation_once(rig: Rig) -> None:
    rig.control.add_rule("commit_then_reset")
    params = {"order_id": "A1042", "currency": "CNY", "payee": "P-7"}
    ops = [rig.enqueue(f"op-{i}", {**params, "amount_minor": 100 + i}) for i in range(20)]
    rig.executor().execute(ops)
    assert {rig.op(o).state for o in ops} == {"unknown"}
    rig.control.clear_rules()
    barrier = threading.Barrier(2)
    reports: list[PassReport] = []

    def run(name: str) -> None:
        reconciler = rig.reconciler(worker=name, batch=20)
        barrier.wait()
        reports.append(reconciler.run_once())

    threads = [threading.Thread(target=run, args=(n,)) for n in ("r1", "r2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.outcomes.get("found", 0) for r in reports) == 20
    assert {rig.op(o).state for o in ops} == {"succeeded"}
    with rig.sessions() as s:
        finds = s.scalar(
            select(func.count())
            .select_from(OperationEvent)
            .where(OperationEvent.to_state == "succeeded")
        )
    assert finds == 20
    assert all(rig.effects(o) == 1 for o in ops)


def test_pass_report_shows_the_oldest_unknown(rig: Rig) -> None:
    op = lost_after_commit(rig)
    rig.control.add_rule("lookup_unavailable")
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(seconds=120))
    report = rig.reconciler().run_once()
    assert report.oldest_unknown_seconds is not None
    assert 119 < report.oldest_unknown_seconds < 300


@pytest.mark.parametrize("fault", ["commit_then_timeout", "reset_before"])
def test_unknown_from_either_side_of_the_commit_ends_succeeded_once(rig: Rig, fault: str) -> None:
    if fault == "commit_then_timeout":
        op = lost_after_commit(rig)
    else:
        rig.control.add_rule("reset_before", times=1)
        op = rig.enqueue()
        rig.executor().execute([op])
        rig.make_quiet(op)
    reconciler = rig.reconciler()
    for _ in range(3):
        reconciler.run_once()
        rig.executor().execute([op])
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1


def done_but_unknown(rig: Rig, n: int) -> list[int]:
    """``n`` operations the downstream carried out whose answers were lost, unknown for longer
    than the review threshold: a lookup recorded "unavailable" now would put them in review."""
    rig.control.add_rule("commit_then_reset", times=n)
    ops = [rig.enqueue(f"op-{i}") for i in range(n)]
    rig.executor().execute(ops)
    assert {rig.op(o).state for o in ops} == {"unknown"}
    for op in ops:
        rig.set(op, unknown_since=datetime.now(UTC) - timedelta(seconds=700))
    return ops


def lookups_asked(rig: Rig, op: int) -> int:
    """Lookups of the operation's key that reached the simulator."""
    return rig.control.requests("acme", rig.op(op).idempotency_key, phase="lookup")


def slow_reconciler(rig: Rig, seconds: float, **kw: object) -> tuple[Reconciler, SlowLookups]:
    """A reconciler whose every lookup (to the simulator) answers ``seconds`` after it starts,
    on a monotonic clock the test moves."""
    mono = FakeMonotonic()
    reconciler = rig.reconciler(monotonic=mono, **kw)
    slow = SlowLookups(rig.gateway(timeout=10.0), mono, seconds)
    reconciler.gateway = slow
    return reconciler, slow


def test_every_lookup_of_a_chunk_has_its_own_time_and_settles_its_operation(rig: Rig) -> None:
    """Four lookups answering in 1.0 s of 1.5 s, one after another in one chunk: each has its
    1.5 s from its own start (the lease, 15 s, holds them all), so each settles its operation
    from its own answer; none is recorded "unavailable" and none reaches review."""
    ops = done_but_unknown(rig, 4)
    reconciler, slow = slow_reconciler(rig, 1.0, client_timeout=1.5)
    assert reconciler.chunk >= 4  # one chunk, one claim
    assert reconciler.run_once().outcomes == {"found": 4}
    assert slow.asked == 4
    for op in ops:
        row = rig.op(op)
        assert (row.state, row.lookups) == ("succeeded", 1)
        assert lookups_asked(rig, op) == 1
        assert rig.reviews(op) == []
        assert rig.effects(op) == 1


def events_of(rig: Rig, op: int) -> list[OperationEvent]:
    with rig.sessions() as s:
        stmt = select(OperationEvent).where(OperationEvent.operation_id == op)
        return list(s.scalars(stmt.order_by(OperationEvent.id)))


@pytest.mark.parametrize("how", ["stalled", "lease_lost"])
def test_lookups_the_lease_leaves_no_time_for_are_not_asked_and_not_recorded(
    rig: Rig, how: str
) -> None:
    """After the second lookup of a chunk the lease is over for the rest: the process stalled
    past it ("stalled"), or the database would not renew it ("lease_lost"). The last two are
    never asked: not recorded "unavailable", not counted, not in review, due again at once
    with an event saying "not asked"; the next pass asks and settles them."""
    ops = done_but_unknown(rig, 4)
    reconciler, slow = slow_reconciler(rig, 1.0, client_timeout=1.5, lease_seconds=60.0)

    def after(number: int) -> None:
        if number != 2:
            return
        if how == "stalled":
            slow.clock.advance(100.0)  # a GC pause, a frozen container: past the 60 s lease
        else:
            with rig.sessions.begin() as s:
                gone = update(Operation).where(Operation.id.in_(ops))
                s.execute(gone.values(lease_until=db_now(-1)))
            assert reconciler.keeper.renew_now() == set()

    slow.after = after
    assert reconciler.run_once().outcomes == {"found": 2, "not_asked": 2}
    assert slow.asked == 2
    found = [o for o in ops if rig.op(o).state == "succeeded"]
    left = [o for o in ops if o not in found]
    assert len(found) == 2 and len(left) == 2
    for op in left:
        row = rig.op(op)
        assert (row.state, row.lookups, row.lease_owner) == ("unknown", 0, None)
        assert row.next_attempt_at is not None and row.next_attempt_at <= datetime.now(UTC)
        assert lookups_asked(rig, op) == 0
        assert rig.reviews(op) == []
        last = events_of(rig, op)[-1]
        assert last.reason == "not_asked" and "lookup" not in (last.evidence or {})
        assert (last.evidence or {})["asked"] is False
    # The next pass asks them.
    assert rig.reconciler(client_timeout=1.5).run_once().outcomes == {"found": 2}
    for op in ops:
        row = rig.op(op)
        assert (row.state, row.lookups) == ("succeeded", 1)
        assert lookups_asked(rig, op) == 1
        assert rig.reviews(op) == []


def test_a_dead_workers_send_the_lease_leaves_no_time_to_ask_about_stays_as_it_was(
    rig: Rig,
) -> None:
    """A ``submitted`` operation (its worker died mid-send) the lease leaves no time to ask
    about: nothing is written (released, it would never be looked at again); once the lease
    lapses the next pass asks and settles it."""
    ops = []
    for i in range(2):
        op = rig.enqueue_on_its_own_order(f"op-{i}")
        rig.sent_by_a_dead_worker(op)
        rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
        ops.append(op)
    before = {op: len(events_of(rig, op)) for op in ops}
    reconciler, slow = slow_reconciler(rig, 1.0, client_timeout=1.5, lease_seconds=60.0)
    slow.after = lambda number: slow.clock.advance(100.0) if number == 1 else None
    assert reconciler.run_once().outcomes == {"found": 1, "not_asked": 1}
    (left,) = [op for op in ops if rig.op(op).state == "submitted"]
    assert (rig.op(left).lookups, lookups_asked(rig, left)) == (0, 0)
    assert len(events_of(rig, left)) == before[left]
    rig.set(left, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler(client_timeout=1.5).run_once().outcomes == {"found": 1}
    assert (rig.op(left).state, rig.op(left).lookups, lookups_asked(rig, left)) == (
        "succeeded",
        1,
        1,
    )


def test_a_chunk_of_slow_lookups_over_http_outlasts_its_first_lease_and_settles_all(
    rig: Rig, sim_proxy: FaultProxy
) -> None:
    """The real simulator behind a proxy that holds every answer 1.2 s; 2.25 s for each lookup
    and a 4.5 s lease, renewed by the keeper while the chunk is worked. Counted from the claim,
    the second lookup would time out and the last two never be asked; each counted from its own
    start, within the lease as renewed (the four take longer than the claim's lease), all four
    are answered."""
    ops = done_but_unknown(rig, 4)
    reconciler = rig.reconciler(client_timeout=2.25, lease_seconds=4.5)
    assert reconciler.chunk == 4
    reconciler.gateway = rig.gateway(url=sim_proxy.url, timeout=10.0)
    sim_proxy.delay(1.2)
    try:
        assert reconciler.run_once().outcomes == {"found": 4}
    finally:
        reconciler.close()
    for op in ops:
        row = rig.op(op)
        assert (row.state, row.lookups) == ("succeeded", 1)
        assert lookups_asked(rig, op) == 1
        assert rig.reviews(op) == []


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("SELECT", None, Exception("server closed the connection")),
        InterfaceError("SELECT", None, Exception("closed"), connection_invalidated=True),
    ],
    ids=["operational", "connection_invalidated"],
)
def test_a_database_gone_mid_reconcile_defers_the_operation_as_it_was(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, error: DBAPIError
) -> None:
    """The database drops the connection (an OperationalError) or the driver finds it dead
    (any DBAPIError with the connection invalidated) while the pass reads the facts: nobody's
    case to review; the operation is left as it was and looked at again after the lease."""
    op = lost_after_commit(rig)

    def gone(session: Any, operation_id: int) -> Any:
        raise error

    with monkeypatch.context() as patched:
        patched.setattr(reconcile, "operation_facts", gone)
        assert rig.reconciler().run_once().outcomes == {"deferred": 1}
    row = rig.op(op)
    assert (row.state, row.lookups) == ("unknown", 0)
    assert rig.reviews(op) == []
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded" and rig.effects(op) == 1


@pytest.mark.parametrize(
    "error",
    [IntegrityError("UPDATE", None, Exception("value refused")), RuntimeError("a bug")],
    ids=["refused", "bug"],
)
def test_an_operations_own_error_puts_it_in_review_and_the_pass_goes_on(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """An error of this operation's own (the database refused a value, its connection is
    fine; a bug): logged, counted as "error", and the operation put in review to be looked
    at again later; the pass goes on with the others."""
    ops = done_but_unknown(rig, 2)
    facts = reconcile.operation_facts

    def refused(session: Any, operation_id: int) -> Any:
        if operation_id == ops[0]:
            raise error
        return facts(session, operation_id)

    monkeypatch.setattr(reconcile, "operation_facts", refused)
    assert rig.reconciler().run_once().outcomes == {"error": 1, "found": 1}
    row = rig.op(ops[0])
    assert row.state == "unknown" and row.lease_owner is None
    assert row.next_attempt_at > datetime.now(UTC) + timedelta(minutes=4)  # MAX_RECHECK
    (item,) = rig.reviews(ops[0])
    assert item.reason == "reconcile_failed"
    assert item.evidence["error"] == type(error).__name__
    assert rig.op(ops[1]).state == "succeeded"


def test_closing_a_reconciler_stops_its_lease_keeper(rig: Rig) -> None:
    """A pass starts the thread that renews its claims' leases; ``close`` stops it (and,
    before any pass, has nothing to stop)."""
    done_but_unknown(rig, 1)
    before = set(threading.enumerate())
    reconciler = rig.reconciler()
    reconciler.close()  # nothing claimed yet: no keeper
    assert reconciler.run_once().outcomes == {"found": 1}
    (keeper,) = [
        t for t in threading.enumerate() if t not in before and t.name == "settled-lease-keeper"
    ]
    assert keeper.is_alive()
    reconciler.close()
    assert not keeper.is_alive()


def test_a_step_seen_at_the_claim_is_recorded_before_the_first_lookup_is_asked(rig: Rig) -> None:
    """Each reading of the database's clock a pass takes is watched, its claim's first: a step
    shown there is recorded, for every process to distrust a "not found", before the pass asks
    a lookup (which may take all its time). The step: between two passes the reconciler's
    monotonic clock runs 100 s ahead of the database's, as a step back of the database's
    clock shows."""
    (op,) = done_but_unknown(rig, 1)
    rig.set(op, next_attempt_at=datetime.now(UTC) + timedelta(hours=1))
    mono = FakeMonotonic()
    reconciler = rig.reconciler(monotonic=mono)
    inner = reconciler.gateway
    recorded_when_asked: list[int] = []

    class Asked:
        def submit(self, request: DownstreamRequest, /, **kw: Any) -> Any:
            return inner.submit(request, **kw)

        def lookup(
            self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
        ) -> LookupOutcome:
            with rig.sessions() as s:
                recorded_when_asked.append(
                    s.scalar(select(func.count()).select_from(ClockStep)) or 0
                )
            return inner.lookup(request, deadline=deadline)

    reconciler.gateway = Asked()
    assert reconciler.run_once().claimed == 0  # a reading of the database's clock
    mono.advance(100.0)
    rig.make_due(op)
    assert reconciler.run_once().outcomes == {"found": 1}
    assert recorded_when_asked == [1]
    with rig.sessions() as s:
        (step,) = s.scalars(select(ClockStep)).all()
    assert (step.direction, step.detected_by) == ("backward", "reconciler:r1")


def test_a_step_seen_as_the_decision_is_read_is_recorded_even_if_the_write_is_refused(
    rig: Rig,
) -> None:
    """The step shows at the reading taken to decide (the lookup took 5 s on the reconciler's
    monotonic clock and none on the database's, as a step back of the database's clock
    shows); meanwhile a newer claim took the operation over, so this pass's write is refused
    and its transaction rolled back. The step is recorded for every process all the same:
    this process has taken the reading in and would not show the step again."""
    (op,) = done_but_unknown(rig, 1)
    reconciler, slow = slow_reconciler(rig, 5.0, client_timeout=10.0)

    def taken_over(number: int) -> None:
        rig.set(op, lease_version=rig.op(op).lease_version + 1)

    slow.after = taken_over
    assert reconciler.run_once().outcomes == {"stale": 1}
    with rig.sessions() as s:
        (step,) = s.scalars(select(ClockStep)).all()
    assert (step.direction, step.detected_by) == ("backward", "reconciler:r1")
    assert step.step_seconds < -3
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler().run_once().outcomes == {"found": 1}


def test_a_not_found_waits_out_a_downstream_clock_lag_another_process_recorded(rig: Rig) -> None:
    """Quiet by the fence alone (the attempt's lease ended a minute ago), but a worker
    recorded the downstream's clock 120 s behind the database's: a request may still land
    by its clock, so the "not found" waits; with a lag of 30 s, long covered, it is sent
    again."""
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    rig.make_quiet(op)
    with rig.sessions.begin() as s:
        record_lag(s, Episode("refund", 120.0, True, db_time(s)), by="w9")
    assert rig.reconciler().run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == "unknown"
    with rig.sessions.begin() as s:
        s.execute(update(DownstreamClockLag).values(lag_seconds=30.0))
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    assert rig.op(op).state == "planned" and rig.sends(op) == 1


def test_a_dead_workers_send_that_cannot_be_reconciled_keeps_its_lease_and_stays_out_of_review(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``submitted`` operation (its worker died mid-send) whose reconcile fails: nothing is
    written, not even the review (released, it would never be looked at again); its lease
    lapses and a later pass looks again."""
    op = rig.enqueue()
    rig.sent_by_a_dead_worker(op)
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    before = len(events_of(rig, op))

    def broken(session: Any, operation_id: int) -> Any:
        raise RuntimeError("a bug")

    with monkeypatch.context() as patched:
        patched.setattr(reconcile, "operation_facts", broken)
        assert rig.reconciler().run_once().outcomes == {"error": 1}
    row = rig.op(op)
    assert (row.state, row.lease_owner) == ("submitted", "reconciler:r1")
    assert rig.reviews(op) == [] and len(events_of(rig, op)) == before
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded" and rig.effects(op) == 1
