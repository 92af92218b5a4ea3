"""The real executor and reconciler against ``outbox.FakeGateway`` and a real database
(PostgreSQL and SQLite): their logic tested without HTTP, as a user of Settled would test it.

Time passes by moving the rows' timestamps, never by sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import sessionmaker

from outbox import FakeGateway
from outbox.clock import Deadline
from outbox.downstream import (
    Found,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.intake import Outbox
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.states import RejectReason, State
from reconciler.reconcile import Reconciler
from workers.executor import Executor

PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


class World:
    """A database, the outbox, one FakeGateway, and the services built on them."""

    def __init__(self, engine: Engine, outbox: Outbox) -> None:
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.outbox = outbox
        self.fake = FakeGateway()

    def executor(self, **kw: Any) -> Executor:
        return Executor(
            sessions=self.sessions,
            gateway=self.fake,
            registry=self.outbox.registry,
            fingerprinter=self.outbox.fingerprinter,
            worker="w1",
            rand=lambda: 0.0,
            **kw,
        )

    def reconciler(self, **kw: Any) -> Reconciler:
        kw.setdefault("client_timeout", 1.0)
        return Reconciler(
            sessions=self.sessions,
            gateway=self.fake,
            registry=self.outbox.registry,
            worker="r1",
            **kw,
        )

    def enqueue(self, op_id: str = "op-1") -> int:
        with self.sessions.begin() as s:
            got = self.outbox.enqueue(s, tenant="acme", op_id=op_id, kind="refund", params=PARAMS)
            return got.operation.id

    def op(self, op_id: int) -> Operation:
        with self.sessions() as s:
            op = s.get(Operation, op_id)
            assert op is not None
            return op

    def key(self, op_id: int) -> str:
        return self.op(op_id).idempotency_key

    def path(self, op_id: int) -> list[tuple[str | None, str]]:
        with self.sessions() as s:
            rows = s.execute(
                select(OperationEvent.from_state, OperationEvent.to_state)
                .where(OperationEvent.operation_id == op_id)
                .order_by(OperationEvent.id)
            )
            return [(a, b) for a, b in rows]

    def reviews(self, op_id: int) -> list[str]:
        with self.sessions() as s:
            items = s.scalars(select(ReviewItem.reason).where(ReviewItem.operation_id == op_id))
            return list(items)

    def quiet_for(self, op_id: int, seconds: float) -> None:
        """The operation's attempts ended ``seconds`` ago (no sleeping)."""
        ago = datetime.now(UTC) - timedelta(seconds=seconds)
        with self.sessions.begin() as s:
            attempts = update(Attempt).where(Attempt.operation_id == op_id)
            s.execute(attempts.values(started_at=ago, not_after=ago))
            s.execute(attempts.where(Attempt.finished_at.is_not(None)).values(finished_at=ago))

    def make_due(self, op_id: int) -> None:
        with self.sessions.begin() as s:
            s.execute(
                update(Operation)
                .where(Operation.id == op_id)
                .values(next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))
            )


@pytest.fixture
def world(engine: Engine, outbox: Outbox) -> World:
    return World(engine, outbox)


SENT = [(None, "planned"), ("planned", "submitted")]


def test_accepted_submit_settles_succeeded_with_the_fakes_receipt(world: World) -> None:
    op = world.enqueue()
    assert world.executor().execute([op]) == {op: State.SUCCEEDED}
    row = world.op(op)
    (call,) = world.fake.calls
    assert (call.method, call.tenant, call.kind) == ("submit", "acme", "refund")
    assert call.op_id == row.op_id  # the operation's identity reaches the port
    assert (call.idempotency_key, dict(call.params)) == (row.idempotency_key, PARAMS)
    assert isinstance(call.deadline, Deadline) and call.deadline.at <= row.deadline
    assert row.receipt is not None and row.receipt["params"] == PARAMS
    assert row.downstream_ref == row.receipt["reference"]
    assert world.fake.effects("acme", row.idempotency_key) == 1
    assert world.path(op) == [*SENT, ("submitted", "succeeded")]


def test_refused_submit_settles_rejected_with_the_reason(world: World) -> None:
    world.fake.script_submit(Refused(RejectReason.BUSINESS_REJECTED, "order_closed", 402))
    op = world.enqueue()
    assert world.executor().execute([op]) == {op: State.REJECTED}
    row = world.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert world.fake.effects("acme", row.idempotency_key) == 0
    assert world.path(op) == [*SENT, ("submitted", "rejected")]


def test_unknown_then_found_by_lookup_settles_succeeded_with_one_effect(world: World) -> None:
    world.fake.script_submit(Unknown("read timeout"), executed=True)  # done, answer lost
    op = world.enqueue()
    assert world.executor().execute([op]) == {op: State.UNKNOWN}
    assert world.executor().execute([op]) == {}  # unknown blocks every new send
    assert world.reconciler().run_once().outcomes == {"found": 1}
    row = world.op(op)
    assert row.state == "succeeded" and row.lookups == 1
    assert row.receipt is not None
    assert row.downstream_ref == row.receipt["reference"]
    assert [(c.method, c.op_id) for c in world.fake.calls] == [
        ("submit", row.op_id),
        ("lookup", row.op_id),
    ]
    assert world.fake.effects("acme", row.idempotency_key) == 1
    assert world.path(op) == [*SENT, ("submitted", "unknown"), ("unknown", "succeeded")]


def test_unknown_then_refusal_found_by_lookup_settles_rejected(world: World) -> None:
    world.fake.script_submit(Unknown("reset"))
    found = Found(Receipt("re_9", "rejected", PARAMS), RejectReason.BUSINESS_REJECTED, "closed")
    world.fake.script_lookup(found)
    op = world.enqueue()
    world.executor().execute([op])
    assert world.reconciler().run_once().outcomes == {"found": 1}
    row = world.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert row.receipt == found.receipt.as_dict()


def test_unknown_then_not_found_after_quiescence_is_requeued_and_sent_with_the_same_key(
    world: World,
) -> None:
    world.fake.script_submit(Unknown("reset before processing"))  # nothing done downstream
    op = world.enqueue()
    key = world.key(op)
    world.executor().execute([op])
    world.quiet_for(op, 60)  # longer than the client timeout plus the processing time
    assert world.reconciler().run_once().outcomes == {"requeued": 1}
    assert world.op(op).state == "planned"
    assert world.executor().execute([op]) == {op: State.SUCCEEDED}
    assert [(c.method, c.idempotency_key) for c in world.fake.calls] == [
        ("submit", key),
        ("lookup", key),
        ("submit", key),
    ]
    assert world.fake.effects("acme", key) == 1
    assert world.path(op) == [
        *SENT,
        ("submitted", "unknown"),
        ("unknown", "planned"),
        ("planned", "submitted"),
        ("submitted", "succeeded"),
    ]


def test_not_found_before_quiescence_waits_and_sends_nothing(world: World) -> None:
    world.fake.script_submit(Unknown("reset before processing"))
    op = world.enqueue()
    world.executor().execute([op])
    assert world.reconciler().run_once().outcomes == {"wait_quiescence": 1}
    row = world.op(op)
    assert row.state == "unknown"
    assert row.next_attempt_at > datetime.now(UTC)  # looks again once quiet
    assert [c.method for c in world.fake.calls] == ["submit", "lookup"]


def test_lookup_unavailable_past_the_threshold_goes_to_review(world: World) -> None:
    world.fake.script_submit(Unknown("read timeout"), executed=True)
    world.fake.script_lookup(Unavailable("lookup down"))
    op = world.enqueue()
    world.executor().execute([op])
    assert world.reconciler(review_after=0.0).run_once().outcomes == {"to_review": 1}
    assert world.op(op).state == "unknown"
    assert world.reviews(op) == ["lookup_unavailable"]
    # The lookup is back: the next look finds it and closes the review with it.
    world.make_due(op)
    assert world.reconciler().run_once().outcomes == {"found": 1}
    assert world.op(op).state == "succeeded"


@pytest.mark.parametrize(
    "not_done",
    [NotSent("connection refused"), NotExecuted(429, retry_after=None)],
    ids=["not_sent", "not_executed"],
)
def test_provably_not_done_is_retried_with_the_same_key(
    world: World, not_done: NotSent | NotExecuted
) -> None:
    world.fake.script_submit(not_done)
    op = world.enqueue()
    executor = world.executor()
    assert executor.execute([op]) == {op: State.PLANNED}
    world.make_due(op)
    assert executor.execute([op]) == {op: State.SUCCEEDED}
    keys = {c.idempotency_key for c in world.fake.submits}
    assert keys == {world.key(op)} and len(world.fake.submits) == 2
    assert world.fake.effects("acme", world.key(op)) == 1


def test_misuse_is_unknown_with_a_review_item(world: World) -> None:
    world.fake.script_submit(Misuse("receipt_mismatch", "the receipt differs", 200))
    op = world.enqueue()
    assert world.executor().execute([op]) == {op: State.UNKNOWN}
    assert world.reviews(op) == ["receipt_mismatch"]


def test_one_hint_delivered_three_times_sends_once(world: World) -> None:
    op = world.enqueue()
    executor = world.executor()
    assert [executor.execute([op]) for _ in range(3)] == [{op: State.SUCCEEDED}, {}, {}]
    assert len(world.fake.submits) == 1


def test_a_batch_is_sent_concurrently_each_with_its_own_key(world: World) -> None:
    ops = [world.enqueue(f"op-{n}") for n in range(5)]
    world.fake.script_submit(
        Refused(RejectReason.INVALID_PARAMS, "bad", 422), key=world.key(ops[2])
    )
    results = world.executor().execute(ops)
    assert results == {op: State.REJECTED if op == ops[2] else State.SUCCEEDED for op in ops}
    assert sorted(c.idempotency_key for c in world.fake.submits) == sorted(
        world.key(op) for op in ops
    )
