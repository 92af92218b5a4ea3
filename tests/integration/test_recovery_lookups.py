"""The executor's recovery lookups (an operation whose worker died mid-send), against the
simulator and a real database (PostgreSQL and SQLite): each lookup of a batch has its own time
from its own start, and one the lease leaves no time for is not asked, nor recorded as an
answer. Time passes on a monotonic clock the test moves (``SlowLookups``), never by sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from outbox.downstream import DownstreamRequest
from outbox.models import OperationEvent
from outbox.states import State
from tests.support.gateways import FakeMonotonic, SlowLookups
from tests.support.rig import Rig
from workers.executor import Executor


def sent_by_a_dead_worker(rig: Rig, n: int) -> list[int]:
    """``n`` operations whose send reached the simulator (a refund each) from a worker that
    died before recording it: ``submitted``, their leases over."""
    ops = []
    for i in range(n):
        op = rig.enqueue_on_its_own_order(f"op-{i}")
        claimed = rig.start_send(op)
        rig.gateway().submit(
            DownstreamRequest(
                "acme",
                claimed.op_id,
                rig.outbox.registry.get("refund"),
                claimed.idempotency_key,
                claimed.params,
            ),
            deadline=datetime.now(UTC) + timedelta(seconds=5),
        )
        rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
        ops.append(op)
    return ops


def slow_executor(rig: Rig, seconds: float, **kw: object) -> tuple[Executor, SlowLookups]:
    """An executor whose every lookup answers ``seconds`` after it starts (on a clock the test
    moves)."""
    mono = FakeMonotonic()
    executor = rig.executor(monotonic=mono, **kw)
    slow = SlowLookups(rig.gateway(timeout=10.0), mono, seconds)
    executor.gateway = slow
    return executor, slow


def lookups_asked(rig: Rig, op: int) -> int:
    return rig.control.requests("acme", rig.op(op).idempotency_key, phase="lookup")


def events(rig: Rig, op: int) -> int:
    with rig.sessions() as s:
        stmt = select(func.count()).where(OperationEvent.operation_id == op)
        return int(s.scalar(stmt.select_from(OperationEvent)) or 0)


def test_each_recovery_lookup_of_a_batch_has_its_own_time(rig: Rig) -> None:
    """Two recovery lookups answering in 3 s, one after the other, with half a lease (5 s)
    each: counted from the claim the second would time out and be recorded "unavailable";
    counted from its own start, it settles its operation from its answer."""
    ops = sent_by_a_dead_worker(rig, 2)
    executor, slow = slow_executor(rig, 3.0, lease_seconds=10.0)
    try:
        assert executor.execute(ops) == {op: State.SUCCEEDED for op in ops}
    finally:
        executor.close()
    assert slow.asked == 2
    for op in ops:
        row = rig.op(op)
        assert (row.state, row.lookups) == ("succeeded", 1)
        assert lookups_asked(rig, op) == 1
        assert rig.effects(op) == 1 and rig.sends(op) == 1


def test_a_recovery_lookup_the_lease_leaves_no_time_for_is_not_asked(rig: Rig) -> None:
    """The worker stalls past its lease after the first recovery lookup: the second is never
    asked, and nothing is recorded of it (not "unavailable", not counted, still
    ``submitted``); once the lease lapses it is recovered from its own lookup."""
    ops = sent_by_a_dead_worker(rig, 2)
    before = {op: events(rig, op) for op in ops}
    executor, slow = slow_executor(rig, 3.0, lease_seconds=60.0)

    def stall(number: int) -> None:
        if number == 1:
            slow.clock.advance(100.0)  # a GC pause, a frozen container: past the 60 s lease

    slow.after = stall
    try:
        written = executor.execute(ops)
    finally:
        executor.close()
    assert slow.asked == 1
    assert list(written.values()) == [State.SUCCEEDED]
    (left,) = [op for op in ops if op not in written]
    row = rig.op(left)
    assert (row.state, row.lookups) == ("submitted", 0)
    assert lookups_asked(rig, left) == 0
    assert events(rig, left) == before[left]
    assert rig.reviews(left) == []
    # Its lease lapses (not renewed any more): the next worker asks, and settles it.
    rig.set(left, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.executor().execute([left]) == {left: State.SUCCEEDED}
    row = rig.op(left)
    assert (row.state, row.lookups) == ("succeeded", 1)
    assert lookups_asked(rig, left) == 1
    assert rig.effects(left) == 1 and rig.sends(left) == 1
