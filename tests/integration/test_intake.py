"""Intake against real PostgreSQL and an SQLite file (each test runs on both)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select
from sqlalchemy.orm import Session

from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    InvalidParams,
    NotFound,
    UnknownKind,
)
from outbox.ids import new_op_id
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent, Run

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}

business = MetaData()
refund_requests = Table(
    "refund_requests",
    business,
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64)),
)


def count(engine: Engine, model: Any = Operation) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def enqueue(outbox: Outbox, session: Session, **kw: Any) -> Any:
    args: dict[str, Any] = {"tenant": "acme", "op_id": "op-9", "kind": "refund", "params": GOOD}
    args.update(kw)
    return outbox.enqueue(session, **args)


def test_intent_commits_with_the_business_row(engine: Engine, outbox: Outbox) -> None:
    business.create_all(engine)
    try:
        with Session(engine) as s, s.begin():
            s.execute(refund_requests.insert().values(order_id="A1042"))
            result = enqueue(outbox, s)
            assert result.created
        with Session(engine) as s:
            op = s.scalars(select(Operation)).one()
            assert (op.tenant, op.op_id, op.state, op.attempts) == ("acme", "op-9", "planned", 0)
            assert op.params == GOOD
            assert op.idempotency_key.startswith("stl_")
            assert op.deadline > op.next_attempt_at
            events = s.scalars(select(OperationEvent)).all()
            assert [(e.from_state, e.to_state, e.actor) for e in events] == [
                (None, "planned", "intake")
            ]
            assert s.scalar(select(func.count()).select_from(refund_requests)) == 1
    finally:
        business.drop_all(engine)


def test_rollback_leaves_neither_business_row_nor_intent(engine: Engine, outbox: Outbox) -> None:
    business.create_all(engine)
    try:
        with Session(engine) as s:
            s.execute(refund_requests.insert().values(order_id="A1042"))
            enqueue(outbox, s)
            s.rollback()
        assert count(engine) == 0
        assert count(engine, OperationEvent) == 0
        with Session(engine) as s:
            assert s.scalar(select(func.count()).select_from(refund_requests)) == 0
    finally:
        business.drop_all(engine)


def test_enqueue_never_commits(engine: Engine, outbox: Outbox) -> None:
    with Session(engine) as s:
        enqueue(outbox, s)
        assert s.in_transaction()
        # Another connection cannot see the uncommitted intent.
        assert count(engine) == 0
        s.rollback()


def test_replay_with_same_intent_returns_the_existing_operation(
    engine: Engine, outbox: Outbox
) -> None:
    with Session(engine) as s, s.begin():
        first = enqueue(outbox, s).operation
        first_id = first.id
    with Session(engine) as s, s.begin():
        op = s.get(Operation, first_id)
        assert op is not None
        op.state, op.receipt = "succeeded", {"reference": "re_1"}  # as if already settled
    with Session(engine) as s, s.begin():
        again = enqueue(outbox, s, params=dict(reversed(list(GOOD.items()))))
        assert not again.created
        assert again.operation.id == first_id
        assert again.operation.state == "succeeded"
        assert again.operation.receipt == {"reference": "re_1"}
    assert count(engine) == 1
    assert count(engine, OperationEvent) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"amount_minor": 20000},
        {"currency": "USD"},
        {"payee": "P-8"},
        {"order_id": "A1043"},
    ],
)
def test_same_op_id_with_other_params_conflicts_and_leaves_the_original(
    engine: Engine, outbox: Outbox, change: dict[str, Any]
) -> None:
    with Session(engine) as s, s.begin():
        enqueue(outbox, s)
    with Session(engine) as s, s.begin():
        with pytest.raises(IdempotencyConflict) as info:
            enqueue(outbox, s, params={**GOOD, **change})
        text = str(info.value.as_dict())
        for value in (*GOOD.values(), *change.values()):
            assert str(value) not in text.replace("op-9", "")
    with Session(engine) as s:
        op = s.scalars(select(Operation)).one()
        assert op.params == GOOD


def test_same_op_id_with_another_kind_conflicts(engine: Engine, outbox: Outbox) -> None:
    with Session(engine) as s, s.begin():
        enqueue(outbox, s)
    with Session(engine) as s, pytest.raises(IdempotencyConflict):
        enqueue(
            outbox,
            s,
            kind="after_sales_ticket",
            params={"ticket_id": "T1", "order_id": "A1042", "reason": "damaged"},
        )


def test_same_op_id_under_two_tenants_is_two_operations(engine: Engine, outbox: Outbox) -> None:
    with Session(engine) as s, s.begin():
        a = enqueue(outbox, s, tenant="acme").operation
        b = enqueue(outbox, s, tenant="globex", params={**GOOD, "amount_minor": 5}).operation
        assert a.id != b.id
        assert a.idempotency_key != b.idempotency_key
    assert count(engine) == 2


def test_tool_call_id_is_correlation_only(engine: Engine, outbox: Outbox) -> None:
    op_id = new_op_id()
    with Session(engine) as s, s.begin():
        op = enqueue(outbox, s, op_id=op_id, correlation_id="call_02").operation
        assert (op.op_id, op.correlation_id) == (op_id, "call_02")
    with Session(engine) as s, pytest.raises(InvalidIdentifier) as info:
        enqueue(outbox, s, op_id="call_02", correlation_id="call_02")
    assert info.value.code == "op_id_is_correlation_id"
    # A retried model turn has a new call id but the same op_id: still one operation.
    with Session(engine) as s, s.begin():
        again = enqueue(outbox, s, op_id=op_id, correlation_id="call_07")
        assert not again.created
    assert count(engine) == 1


def test_run_of_another_tenant_is_not_found(engine: Engine, outbox: Outbox) -> None:
    with Session(engine) as s, s.begin():
        run = Run(tenant="globex", handle="h" * 32)
        s.add(run)
        s.flush()
        with pytest.raises(NotFound):
            enqueue(outbox, s, run=run)
    assert count(engine) == 0


BAD_INPUT: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("negative amount", {"params": {**GOOD, "amount_minor": -1}}, InvalidParams, "invalid_params"),
    ("zero amount", {"params": {**GOOD, "amount_minor": 0}}, InvalidParams, "invalid_params"),
    ("float amount", {"params": {**GOOD, "amount_minor": 1.0}}, InvalidParams, "invalid_params"),
    ("bool amount", {"params": {**GOOD, "amount_minor": True}}, InvalidParams, "invalid_params"),
    ("str amount", {"params": {**GOOD, "amount_minor": "1"}}, InvalidParams, "invalid_params"),
    ("huge amount", {"params": {**GOOD, "amount_minor": 10**19}}, InvalidParams, "invalid_params"),
    ("NaN", {"params": {**GOOD, "amount_minor": float("nan")}}, InvalidParams, "params_not_json"),
    ("lower currency", {"params": {**GOOD, "currency": "cny"}}, InvalidParams, "invalid_params"),
    ("bad currency", {"params": {**GOOD, "currency": "ZZZ"}}, InvalidParams, "invalid_params"),
    ("unknown field", {"params": {**GOOD, "memo": "x"}}, InvalidParams, "invalid_params"),
    ("missing field", {"params": {"order_id": "A1"}}, InvalidParams, "invalid_params"),
    ("oversized", {"params": {**GOOD, "x": "y" * 9000}}, InvalidParams, "params_too_large"),
    ("unknown kind", {"kind": "payout"}, UnknownKind, "unknown_kind"),
    ("empty op_id", {"op_id": ""}, InvalidIdentifier, "invalid_op_id"),
    ("overlong op_id", {"op_id": "o" * 81}, InvalidIdentifier, "invalid_op_id"),
    ("space op_id", {"op_id": "op 9"}, InvalidIdentifier, "invalid_op_id"),
    ("confusable op_id", {"op_id": "оp-9"}, InvalidIdentifier, "invalid_op_id"),
    ("SQL op_id", {"op_id": "x';DROP TABLE operations;--"}, InvalidIdentifier, "invalid_op_id"),
    ("empty tenant", {"tenant": ""}, InvalidIdentifier, "invalid_tenant"),
    ("overlong tenant", {"tenant": "t" * 64}, InvalidIdentifier, "invalid_tenant"),
    ("space tenant", {"tenant": " acme"}, InvalidIdentifier, "invalid_tenant"),
    ("confusable tenant", {"tenant": "аcme"}, InvalidIdentifier, "invalid_tenant"),
    ("SQL tenant", {"tenant": "a' OR '1'='1"}, InvalidIdentifier, "invalid_tenant"),
    ("zero attempts", {"max_attempts": 0}, InvalidInput, "invalid_budget"),
    (
        "long correlation",
        {"correlation_id": "c" * 201},
        InvalidIdentifier,
        "invalid_correlation_id",
    ),
]


@pytest.mark.parametrize(
    ("case", "kwargs", "error", "code"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_raises_a_typed_error_and_writes_nothing(
    engine: Engine,
    outbox: Outbox,
    case: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    code: str,
) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(error) as info:
            enqueue(outbox, s, **kwargs)
        assert getattr(info.value, "code", None) == code
        assert not s.new
    assert count(engine) == 0
    assert count(engine, OperationEvent) == 0


@pytest.mark.postgres
def test_concurrent_intake_of_one_op_id_makes_exactly_one_row(pg: Engine, outbox: Outbox) -> None:
    n = 8
    barrier = threading.Barrier(n)
    results: list[str] = []
    lock = threading.Lock()

    def intake(i: int) -> None:
        params = GOOD if i % 2 == 0 else {**GOOD, "amount_minor": 20000}
        try:
            with Session(pg) as s, s.begin():
                barrier.wait()
                got = enqueue(outbox, s, params=params)
                outcome = "created" if got.created else "existing"
        except IdempotencyConflict:
            outcome = "conflict"
        except Exception as exc:  # pragma: no cover - the failure this test looks for
            outcome = f"error: {exc!r}"
        with lock:
            results.append(f"{i % 2}:{outcome}")

    threads = [threading.Thread(target=intake, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert count(pg) == 1
    assert len(results) == n
    assert not [r for r in results if "error" in r]
    assert sum(r.endswith("created") for r in results) == 1
    with Session(pg) as s:
        winner_amount = s.scalars(select(Operation)).one().params["amount_minor"]
    winner_parity = "0" if winner_amount == 10000 else "1"
    for r in results:
        parity, outcome = r.split(":")
        assert outcome in ({"created", "existing"} if parity == winner_parity else {"conflict"})
