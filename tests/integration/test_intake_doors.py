"""The intake contract on every door (``tests.support.doors``): the app's SQLAlchemy ``Session``
(on PostgreSQL and an SQLite file) and its ``AsyncSession`` (on PostgreSQL), each case asserted
the same way on each.

A replay returns the same operation and writes nothing; another intent under the same op_id is
a conflict; op_ids are scoped by tenant; bad input is the same typed error on every door and
writes nothing; a rollback leaves nothing and publishes nothing; a commit publishes one hint
with the new id; an intent costs at most two statements; and a real Celery worker settles what
each door enqueued, brought by the door's hints alone."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    InvalidParams,
    UnknownKind,
)
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent
from outbox.prune import prune
from settled.celery_app import hint_publisher
from settled.simulator import SimulatorControl
from tests.integration.test_celery_worker import (
    App,
    app,
    assert_at_most_one_effect,
    broker_url,
    stack,
    wait_settled,
)
from tests.support.doors import DOORS, Door, app_rows
from tests.support.stack import Stack

_FIXTURES = (app, broker_url, stack)  # the real worker's, from tests.integration.test_celery_worker

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
TICKET = {"ticket_id": "T1", "order_id": "A1042", "reason": "damaged"}

CASES = [
    pytest.param(
        (door, database),
        id=f"{door.name}-{database}",
        marks=[pytest.mark.postgres] if database == "postgresql" else [],
    )
    for door in DOORS
    for database in sorted(door.databases)
]


def intent(**kw: Any) -> dict[str, Any]:
    """``enqueue``'s arguments: one refund of acme's unless told otherwise."""
    return {"tenant": "acme", "op_id": "op-9", "kind": "refund", "params": GOOD, **kw}


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[type[Door], str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def db(request: pytest.FixtureRequest, case: tuple[type[Door], str]) -> Iterator[Engine]:
    """The test's own engine on the door's database (emptied after the test), with the app's
    table."""
    engine: Engine = request.getfixturevalue("pg" if case[1] == "postgresql" else "sqlite")
    app_rows.create(engine)
    yield engine
    app_rows.drop(engine)


@pytest.fixture
def door(case: tuple[type[Door], str], db: Engine, outbox: Outbox) -> Iterator[Door]:
    opened = case[0](db.url.render_as_string(hide_password=False), outbox)
    yield opened
    opened.close()


def written(engine: Engine) -> tuple[int, int, int]:
    """What is committed: (operations, operation events, the app's rows)."""
    with Session(engine) as s:
        return (
            int(s.scalar(select(func.count()).select_from(Operation)) or 0),
            int(s.scalar(select(func.count()).select_from(OperationEvent)) or 0),
            int(s.scalar(select(func.count()).select_from(app_rows)) or 0),
        )


def test_a_commit_publishes_one_hint_carrying_the_new_id(door: Door, db: Engine) -> None:
    with door.begin() as tx:
        tx.app_write("A1042")
        got = tx.enqueue(**intent(correlation_id="call-1"))
        assert (door.hints, written(db)) == ([], (0, 0, 0))  # nothing before the commit
        tx.commit()
    assert door.hints == [[got.id]]
    assert written(db) == (1, 1, 1)  # the app's row and the intent, together
    with Session(db) as s:
        stored = s.scalars(select(Operation)).one()
    assert got.created and (stored.id, stored.tenant, stored.op_id) == (got.id, "acme", "op-9")
    assert (got.state, got.idempotency_key) == ("planned", stored.idempotency_key)


def test_a_rollback_leaves_no_row_and_publishes_no_hint(door: Door, db: Engine) -> None:
    with door.begin() as tx:
        tx.app_write("A1042")
        assert tx.enqueue(**intent()).created
        tx.rollback()
    assert written(db) == (0, 0, 0)
    assert door.hints == []


def test_a_replay_returns_the_same_operation_and_writes_nothing(door: Door, db: Engine) -> None:
    with door.begin() as tx:
        first = tx.enqueue(**intent())
        tx.commit()
    with Session(db) as s, s.begin():  # as if a worker had settled it meanwhile
        s.execute(update(Operation).values(state="succeeded", receipt={"reference": "re_1"}))
    with door.begin() as tx:
        again = tx.enqueue(**intent(params=dict(reversed(list(GOOD.items())))))
        tx.commit()
    assert not again.created
    assert (again.id, again.idempotency_key) == (first.id, first.idempotency_key)
    assert again.state == "succeeded"  # the stored operation, with its result
    assert written(db) == (1, 1, 0)
    assert door.hints == [[first.id]]  # the replay's commit hints nothing


def test_a_replay_of_a_pruned_operation_is_answered_from_its_tombstone(
    door: Door, db: Engine
) -> None:
    with door.begin() as tx:
        first = tx.enqueue(**intent())
        tx.commit()
    then = datetime.now(UTC) - timedelta(days=100)
    with Session(db) as s, s.begin():  # settled long ago
        s.execute(update(Operation).values(state="succeeded", downstream_ref="re_1",
                                           created_at=then, updated_at=then))  # fmt: skip
        s.execute(update(OperationEvent).values(at=then))
    assert prune(db, timedelta(days=90)).operations == 1
    with door.begin() as tx:
        again = tx.enqueue(**intent())
        with pytest.raises(IdempotencyConflict):
            tx.enqueue(**intent(params={**GOOD, "amount_minor": 20000}))
        tx.commit()
    assert (again.created, again.id, again.state) == (False, None, "succeeded")
    assert again.pruned is not None and again.pruned.reference == "re_1"
    assert again.idempotency_key == first.idempotency_key
    assert written(db) == (0, 0, 0)  # no second operation
    assert door.hints == [[first.id]]  # the replay's commit hints nothing


@pytest.mark.parametrize(
    "other",
    [
        intent(params={**GOOD, "amount_minor": 20000}),
        intent(kind="after_sales_ticket", params=TICKET),
    ],
    ids=["other-amount", "other-kind"],
)
def test_another_intent_under_the_same_op_id_is_a_conflict_that_writes_nothing(
    door: Door, db: Engine, other: dict[str, Any]
) -> None:
    with door.begin() as tx:
        first = tx.enqueue(**intent())
        tx.commit()
    with door.begin() as tx:
        with pytest.raises(IdempotencyConflict) as refused:
            tx.enqueue(**other)
        tx.commit()  # the app commits the rest of its transaction: nothing of the refused one
    assert refused.value.code == "idempotency_conflict"
    assert written(db) == (1, 1, 0)
    with Session(db) as s:
        assert s.scalars(select(Operation.params)).one() == GOOD  # the stored one untouched
    assert door.hints == [[first.id]]


def test_an_op_id_is_scoped_by_its_tenant(door: Door, db: Engine) -> None:
    with door.begin() as tx:
        acme = tx.enqueue(**intent())
        tx.commit()
    # The same op_id for another tenant, with another intent: not a conflict (the other
    # tenant's replay does not see acme's operation) but an operation of its own.
    theirs = intent(tenant="globex", params={**GOOD, "amount_minor": 5})
    with door.begin() as tx:
        globex = tx.enqueue(**theirs)
        tx.commit()
    with door.begin() as tx:
        globex_again = tx.enqueue(**theirs)
        acme_again = tx.enqueue(**intent())
        tx.commit()
    assert acme.created and globex.created
    assert globex.id != acme.id and globex.idempotency_key != acme.idempotency_key
    assert (globex_again.id, globex_again.created) == (globex.id, False)
    assert (acme_again.id, acme_again.created) == (acme.id, False)
    assert written(db) == (2, 2, 0)
    assert door.hints == [[acme.id], [globex.id]]


BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("empty tenant", {"tenant": ""}, InvalidIdentifier, "invalid_tenant"),
    ("confusable tenant", {"tenant": "аcme"}, InvalidIdentifier, "invalid_tenant"),
    ("empty op_id", {"op_id": ""}, InvalidIdentifier, "invalid_op_id"),
    ("space op_id", {"op_id": "op 9"}, InvalidIdentifier, "invalid_op_id"),
    ("overlong op_id", {"op_id": "o" * 81}, InvalidIdentifier, "invalid_op_id"),
    ("unknown kind", {"kind": "payout"}, UnknownKind, "unknown_kind"),
    ("bool amount", {"params": {**GOOD, "amount_minor": True}}, InvalidParams, "invalid_params"),
    ("str amount", {"params": {**GOOD, "amount_minor": "100"}}, InvalidParams, "invalid_params"),
    ("zero amount", {"params": {**GOOD, "amount_minor": 0}}, InvalidParams, "invalid_params"),
    ("naive deadline", {"deadline": datetime(2099, 1, 1)}, InvalidInput, "invalid_budget"),
    ("past deadline", {"deadline": datetime(2000, 1, 1, tzinfo=UTC)}, InvalidInput,
     "invalid_budget"),
    ("str deadline", {"deadline": "2099-01-01T00:00:00Z"}, InvalidInput, "invalid_budget"),
]  # fmt: skip


@pytest.mark.parametrize(("case_", "bad", "error", "code"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_the_same_typed_error_on_every_door_and_writes_nothing(
    door: Door, db: Engine, case_: str, bad: dict[str, Any], error: type[Exception], code: str
) -> None:
    with door.begin() as tx:
        with pytest.raises(error) as refused:
            tx.enqueue(**intent(**bad))
        assert door.last_statements == []  # refused before any SQL
        tx.commit()  # the app commits the rest of its transaction: nothing of the refused one
    assert type(refused.value) is error  # that class on every door, not a subclass
    assert getattr(refused.value, "code", None) == code
    assert written(db) == (0, 0, 0)
    assert door.hints == []


def test_an_intent_costs_at_most_two_statements(door: Door) -> None:
    with door.begin() as tx:
        tx.enqueue(**intent())
        new = door.last_statements
        tx.commit()
    with door.begin() as tx:
        tx.enqueue(**intent())
        replay = door.last_statements
        with pytest.raises(IdempotencyConflict):
            tx.enqueue(**intent(params={**GOOD, "amount_minor": 1}))
        conflict = door.last_statements
        tx.commit()
    assert len(new) == 1, new  # the operation and its created event, in one statement
    assert len(replay) <= 2, replay  # the insert that inserted nothing, and the stored row
    assert len(conflict) <= 2, conflict


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize(
    "door_class", [d for d in DOORS if "postgresql" in d.databases], ids=lambda d: d.name
)
def test_a_real_worker_settles_what_each_door_enqueued(
    door_class: type[Door],
    app: App,
    stack: Stack,
    pg_url: str,
    outbox: Outbox,
    sim_control: SimulatorControl,
) -> None:
    # No beat, so no sweeper: only the hints the door published after each commit bring
    # these operations to the worker.
    stack.start_worker(pool="prefork", concurrency=2, beat=False)
    door = door_class(pg_url, outbox, publish=hint_publisher(app.celery))
    ids = []
    try:
        for i in range(3):
            with door.begin() as tx:
                params = {**GOOD, "amount_minor": 100 + i}
                got = tx.enqueue(**intent(op_id=f"op-{door.name}-{i}", params=params))
                tx.commit()
            ids.append(got.id)
    finally:
        door.close()
    assert door.hints == [[i] for i in ids]
    assert set(wait_settled(app, stack, ids).values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 3
    assert [sim_control.requests("acme", key) for key in app.keys(ids)] == [1] * 3
