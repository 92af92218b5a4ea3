"""The reconciler against the simulator and a real database (PostgreSQL and SQLite).

Every operation ends succeeded, rejected or in review with evidence; the simulator's ledger
confirms each settled one.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from outbox import runs
from outbox.db import db_now
from outbox.downstream import DownstreamRequest
from outbox.kinds import default_registry
from outbox.models import Operation, OperationEvent, Run
from outbox.states import State
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
    rig.start_send(op)
    rig.gateway().submit(
        DownstreamRequest(
            "acme",
            rig.op(op).op_id,
            default_registry().get("refund"),
            rig.op(op).idempotency_key,
            rig.op(op).params,
        ),
        deadline=datetime.now(UTC) + timedelta(seconds=5),
    )
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
        claimed = rig.start_send(op)
        rig.gateway().submit(
            DownstreamRequest(
                "acme",
                claimed.op_id,
                default_registry().get("refund"),
                claimed.idempotency_key,
                claimed.params,
            ),
            deadline=datetime.now(UTC) + timedelta(seconds=5),
        )
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
