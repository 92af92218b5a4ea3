"""Waking the operations that wait after refusals when their downstream is back, against
PostgreSQL and SQLite: the wake statement (only the right rows, bounded, a Retry-After
honoured), the executor's wake after an answered send, and beat's recovery probe.

Time passes by moving the rows' timestamps, never by sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, update

from outbox.downstream import NotExecuted, NotSent, Refused
from outbox.intake import Outbox
from outbox.models import Operation
from outbox.states import RejectReason, State
from outbox.storage import storage_for
from outbox.storage.operations import db_time
from outbox.storage.transitions import Note
from outbox.storage.waking import wake_waiting
from tests.integration.test_fake_gateway import World
from workers.downstreams import Downstreams
from workers.recovery_probe import RecoveryProbe

HOUR = timedelta(hours=1)


class Waits(World):
    """The fake-gateway world, with operations made to wait in each way there is."""

    def deferred(self, op_id: str, outcome: Any = None) -> int:
        """An operation whose one try was refused before anything ran (not sent, by
        default): ``planned`` again, waiting an hour on its backoff."""
        id_ = self.enqueue(op_id)
        self.fake.script_submit(outcome or NotSent("connection refused"), key=self.key(id_))
        assert self.executor().execute([id_]) == {id_: State.PLANNED}
        self.wait(id_, HOUR)
        return id_

    def wait(self, id_: int, delta: timedelta) -> None:
        """Its next try ``delta`` from now (negative: due already)."""
        with self.sessions.begin() as s:
            s.execute(
                update(Operation)
                .where(Operation.id == id_)
                .values(next_attempt_at=datetime.now(UTC) + delta)
            )

    def due(self, id_: int) -> bool:
        with self.sessions() as s:
            op = s.get(Operation, id_)
            assert op is not None
            return op.next_attempt_at <= db_time(s)

    def wake(self, limit: int = 10, kinds: tuple[str, ...] = ("refund",)) -> list[int]:
        storage = storage_for(self.sessions)
        return storage.step(lambda conn: wake_waiting(conn, kinds=kinds, limit=limit))

    def probe(self) -> RecoveryProbe:
        return RecoveryProbe(
            sessions=self.sessions,
            gateway=self.fake,
            registry=self.outbox.registry,
            downstreams=Downstreams(),
            limit=10,
        )


@pytest.fixture
def waits(engine: Engine, outbox: Outbox) -> Waits:
    return Waits(engine, outbox)


def test_wake_makes_due_only_the_operations_waiting_after_a_refusal(waits: Waits) -> None:
    refused = waits.deferred("refused")
    limited = waits.deferred("limited", NotExecuted(429))
    fresh = waits.enqueue("fresh")
    waits.wait(fresh, HOUR)  # planned, never sent, to go later: not waiting on a refusal
    held = waits.deferred("held")
    # held back after its refusal (a look: planned -> planned), e.g. a worker that could not
    # check it: it waits for that, not for the downstream
    storage = storage_for(waits.sessions)
    storage.step(
        lambda conn: storage.write_transitions(conn, [Note(held, note="held")], actor="w2")
    )
    leased = waits.deferred("leased")
    with waits.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == leased)
            .values(lease_until=datetime.now(UTC) + HOUR, lease_owner="w2")
        )

    assert waits.wake(kinds=("ticket",)) == []  # not their downstream's kinds
    assert waits.wake() == sorted([refused, limited])
    assert waits.due(refused) and waits.due(limited)
    assert not any(waits.due(i) for i in (fresh, held, leased))
    assert waits.wake() == []  # woken ones are due: nothing waits any more


def test_wake_is_bounded_and_takes_the_oldest_waits_first(waits: Waits) -> None:
    ids = [waits.deferred(f"op-{n}") for n in range(5)]
    for n, id_ in enumerate(ids):
        waits.wait(id_, HOUR - timedelta(minutes=n))  # the last one is due soonest
    assert waits.wake(limit=2) == sorted(ids[3:])
    assert waits.wake(limit=2) == sorted(ids[1:3])
    assert waits.wake(limit=2) == [ids[0]]


def test_wake_waits_while_a_retry_after_of_the_downstream_holds(waits: Waits) -> None:
    refused = waits.deferred("refused")
    told = waits.enqueue("told")
    waits.fake.script_submit(NotExecuted(429, retry_after=600.0), key=waits.key(told))
    assert waits.executor().execute([told]) == {told: State.PLANNED}
    # The downstream said "not before 10 minutes": neither it nor another op is hurried.
    assert waits.wake() == []
    assert not waits.due(refused) and not waits.due(told)
    waits.wait(told, -timedelta(seconds=1))  # its Retry-After is over
    assert waits.wake() == [refused]


def test_an_answered_send_wakes_a_batch_of_the_waiting(waits: Waits) -> None:
    executor = waits.executor(max_batch=2)
    waiting = []
    for n in range(3):
        id_ = waits.enqueue(f"w-{n}")
        waits.fake.script_submit(NotSent("connection refused"), key=waits.key(id_))
        assert executor.execute([id_]) == {id_: State.PLANNED}
        waits.wait(id_, HOUR - timedelta(minutes=n))
        waiting.append(id_)
    back = waits.enqueue("back")
    assert executor.execute([back]) == {back: State.SUCCEEDED}
    assert [waits.due(i) for i in waiting] == [False, True, True]  # a batch: max_batch
    # Their sends answered wake the next batch (half-open).
    assert executor.execute(waiting[1:]) == dict.fromkeys(waiting[1:], State.SUCCEEDED)
    assert waits.due(waiting[0])


def test_a_refused_or_unanswered_send_wakes_nothing(waits: Waits) -> None:
    executor = waits.executor()
    first = waits.enqueue("first")
    waits.fake.script_submit(NotSent("connection refused"), key=waits.key(first))
    executor.execute([first])
    waits.wait(first, HOUR)
    again = waits.enqueue("again")
    waits.fake.script_submit(NotExecuted(503), key=waits.key(again))
    assert executor.execute([again]) == {again: State.PLANNED}
    assert not waits.due(first)
    # a refusal on the merits is an answer: the downstream is processing
    last = waits.enqueue("refused-on-merits")
    waits.fake.script_submit(
        Refused(RejectReason.BUSINESS_REJECTED, code="balance_insufficient", status=402),
        key=waits.key(last),
    )
    assert executor.execute([last]) == {last: State.REJECTED}
    assert waits.due(first) and waits.due(again)


def test_a_process_that_saw_no_refusal_runs_no_wake(waits: Waits) -> None:
    waiting = waits.deferred("waiting")  # refused in another executor's process
    back = waits.enqueue("back")
    assert waits.executor().execute([back]) == {back: State.SUCCEEDED}
    # Nothing told this process anything waits: the recovery probe is what finds it.
    assert not waits.due(waiting)
    assert waits.probe().run_once() == [waiting]


def test_the_recovery_probe_wakes_only_once_a_lookup_answers(waits: Waits) -> None:
    probe = waits.probe()
    assert probe.run_once() == []
    assert waits.fake.lookups == []  # nothing waits: no probe
    waiting = waits.deferred("waiting")
    waits.fake.unreachable = True
    assert probe.run_once() == []
    assert not waits.due(waiting)
    waits.fake.unreachable = False
    assert probe.run_once() == [waiting]  # not found: it answers, and nothing ran
    assert waits.due(waiting)
    assert [c.idempotency_key for c in waits.fake.lookups] == [waits.key(waiting)] * 2


def test_no_recovery_probe_while_the_downstream_is_being_sent_to(waits: Waits) -> None:
    waiting = waits.deferred("waiting")
    sending = waits.enqueue("sending")
    with waits.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == sending)
            .values(state="submitted", lease_until=datetime.now(UTC) + HOUR, lease_owner="w2")
        )
    assert waits.probe().run_once() == []
    assert waits.fake.lookups == []
    assert not waits.due(waiting)
