"""Intake against real PostgreSQL and an SQLite file (each test runs on both)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, func, select
from sqlalchemy.orm import Session, make_transient

from outbox import runs
from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    InvalidParams,
    NotFound,
    UnknownKind,
)
from outbox.fingerprint import canonical_params
from outbox.ids import CORRELATION_ID_RE, OP_ID_RE, derive_idempotency_key, new_op_id
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent, Run

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
PICKUP = {"ticket_id": "T1", "day": "2026-12-01", "slot": "morning"}


class OddTZ(tzinfo):
    """A tzinfo whose utcoffset() returns what it was given: None (so the datetime is naive
    after all), something that is not an offset, or one out of range."""

    def __init__(self, offset: object) -> None:
        self.offset = offset

    def utcoffset(self, dt: datetime | None) -> Any:
        return self.offset

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None


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


@contextmanager
def statements(engine: Engine) -> Iterator[list[str]]:
    """The statements run on ``engine`` meanwhile, by their first word (SQLite's BEGIN left
    out: PostgreSQL's is implicit)."""
    seen: list[str] = []

    def keep(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if not statement.startswith("BEGIN"):
            seen.append(statement.split(None, 1)[0])

    event.listen(engine, "before_cursor_execute", keep)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", keep)


def _created_events(engine: Engine, operation_id: int) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            select(
                OperationEvent.from_state,
                OperationEvent.to_state,
                OperationEvent.actor,
                OperationEvent.lease_version,
                OperationEvent.reason,
                OperationEvent.evidence,
                OperationEvent.at == Operation.created_at,
            )
            .join(Operation, Operation.id == OperationEvent.operation_id)
            .where(OperationEvent.operation_id == operation_id)
        )
        return [tuple(r) for r in rows]


def test_an_intake_is_one_statement_and_loads_nothing(engine: Engine, outbox: Outbox) -> None:
    # The hot path: one statement writes the operation and its created event row
    # (PostgreSQL: a data-modifying CTE; SQLite: the trigger of migration 0009) and returns
    # the new row's values, loading no entity into the session; a replay or a conflict
    # reads the stored operation instead. Nothing else.
    first = "WITH" if engine.dialect.name == "postgresql" else "INSERT"
    with Session(engine) as s, s.begin(), statements(engine) as new:
        got = enqueue(outbox, s, correlation_id="call-1")
        assert got.created
        assert len(s.identity_map) == 0
    with Session(engine) as s, s.begin(), statements(engine) as replay:
        assert not enqueue(outbox, s, correlation_id="call-1").created
    with Session(engine) as s, statements(engine) as conflict:
        with pytest.raises(IdempotencyConflict):
            enqueue(outbox, s, params={**GOOD, "amount_minor": 1})
        s.rollback()
    assert new == [first]
    assert replay == conflict == [first, "SELECT"]
    # The one event row, written by that statement, at the row's own creation time.
    evidence = {"correlation_id": "call-1"}
    assert _created_events(engine, got.id) == [
        (None, "planned", "intake", None, None, evidence, True)
    ]


def test_the_created_event_without_a_correlation_id_has_no_evidence(
    engine: Engine, outbox: Outbox
) -> None:
    with Session(engine) as s, s.begin():
        got = enqueue(outbox, s)
    assert _created_events(engine, got.id) == [(None, "planned", "intake", None, None, None, True)]


def test_enqueued_holds_the_new_rows_values_and_loads_it_on_first_use(
    engine: Engine, outbox: Outbox
) -> None:
    deadline = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    with Session(engine) as s, s.begin():
        got = enqueue(outbox, s, correlation_id="call-7", deadline=deadline)
        assert (got.tenant, got.op_id, got.kind, got.state) == ("acme", "op-9", "refund", "planned")
        assert (got.deadline, got.correlation_id, got.run_id) == (deadline, "call-7", None)
        key = derive_idempotency_key(outbox.idempotency_secret, "acme", "op-9")
        assert got.idempotency_key == key
        with statements(engine) as loading:
            op = got.operation
            assert got.operation is op  # read once
        assert loading == ["SELECT"]
        assert (op.id, op.op_id, op.idempotency_key) == (got.id, "op-9", got.idempotency_key)
        assert op in s
    with Session(engine) as s, s.begin():
        later = enqueue(outbox, s, op_id="op-read-later")
    # After the transaction: a copy read on its own, the app's session left closed (no
    # transaction begun in it again, so no connection held and no lock kept).
    assert (later.operation.op_id, later.operation.state) == ("op-read-later", "planned")
    assert later.operation not in s and not s.in_transaction()
    with Session(engine) as s:
        gone = enqueue(outbox, s, op_id="op-rolled-back")
        s.rollback()
        with pytest.raises(NotFound) as err:
            _ = gone.operation
        assert err.value.code == "operation_not_found"


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
    *[
        (f"correlation {v!r}", {"correlation_id": v}, InvalidIdentifier, "invalid_correlation_id")
        for v in ["a\x00b", "\ud800", "", " call_02", "call 02", "cäll_02", "call_٣", 'c"1', 7]
    ],
    *[
        (f"pickup day {day}", {"kind": "pickup", "params": {**PICKUP, "day": day}},
         InvalidParams, "invalid_params")
        for day in ["20٣٣-01-01", "20𝟘𝟘-01-01", "2024-02-31"]
    ],
    *[
        (case, {"deadline": deadline}, InvalidInput, "invalid_budget")
        for case, deadline in [
            ("naive deadline", datetime(2099, 1, 1)),
            ("past deadline", datetime(2000, 1, 1, tzinfo=UTC)),
            ("offsetless tzinfo", datetime(2099, 1, 1, tzinfo=OddTZ(None))),
            ("tzinfo offset not a timedelta", datetime(2099, 1, 1, tzinfo=OddTZ("x"))),
            ("tzinfo offset over a day", datetime(2099, 1, 1, tzinfo=OddTZ(timedelta(days=2)))),
            ("past year 9999 in UTC", datetime.max.replace(tzinfo=timezone(-timedelta(hours=5)))),
            ("string deadline", "2099-01-01T00:00:00Z"),
            ("date deadline", date(2099, 1, 1)),
        ]
    ],
    ("unstored run", {"run": Run(tenant="acme", handle="run_" + "a" * 32)},
     InvalidInput, "invalid_run"),
    ("not a run", {"run": "run_" + "a" * 32}, InvalidInput, "invalid_run"),
    ("unstored compensated op", {"compensates": Operation(tenant="acme", op_id="op-1")},
     InvalidInput, "invalid_compensates"),
    ("not an operation", {"compensates": 1}, InvalidInput, "invalid_compensates"),
]  # fmt: skip


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


def test_a_run_whose_insert_was_rolled_back_is_refused(engine: Engine, outbox: Outbox) -> None:
    with Session(engine) as s:
        run = runs.open_run(s, tenant="acme")
        s.rollback()  # the run's row is gone; the object still holds its id
        assert run.id is not None
        with pytest.raises(InvalidInput) as info:
            enqueue(outbox, s, run=run)
        assert info.value.code == "invalid_run"
        s.rollback()
    assert count(engine) == 0


def test_correlation_id_errors_carry_no_sql_parameters(engine: Engine, outbox: Outbox) -> None:
    # The DataError this used to raise printed the statement's parameters: the fingerprint and
    # the idempotency key of the intent.
    with Session(engine) as s, s.begin():
        for bad in ["a\x00b", "\ud800"]:
            with pytest.raises(InvalidIdentifier) as info:
                enqueue(outbox, s, correlation_id=bad)
            text = repr(info.value) + repr(info.value.as_dict())
            assert "stl_" not in text and "A1042" not in text and bad not in text
    assert count(engine) == 0


@pytest.mark.parametrize(
    "correlation_id", ["call_02", "toolu_01A09q90qw90lq917835lq9", "c2VjcmV0/Ym9keQ+=="]
)
def test_well_formed_correlation_ids_are_stored(
    engine: Engine, outbox: Outbox, correlation_id: str
) -> None:
    with Session(engine) as s, s.begin():
        enqueue(outbox, s, correlation_id=correlation_id)
    with Session(engine) as s:
        assert s.scalars(select(Operation.correlation_id)).one() == correlation_id
        evidence = s.scalars(select(OperationEvent.evidence)).one()
        assert evidence == {"correlation_id": correlation_id}


def test_an_aware_deadline_in_any_offset_is_stored_as_that_instant(
    engine: Engine, outbox: Outbox
) -> None:
    deadline = datetime(2099, 1, 1, 8, tzinfo=timezone(timedelta(hours=8)))
    with Session(engine) as s, s.begin():
        enqueue(outbox, s, deadline=deadline)
    with Session(engine) as s:
        assert s.scalars(select(Operation.deadline)).one() == datetime(2099, 1, 1, tzinfo=UTC)


# -- fuzzing every argument ----------------------------------------------------------------

NASTY = [
    "", " ", "\x00", "a\x00b", "\ud800", "a\udfffb", "٣", "20٣٣", "𝟘", "Ａ", "a\n", "a\r\nb",
    "'", '"', "\\", "%00", "x" * 300, "op-9", "call_02", "acme", "\u200b", "\ufeffa",
]  # fmt: skip
any_text = st.text(st.characters(exclude_categories=()), max_size=90)
junk = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.binary(max_size=8), st.just(["a"])
)
bad_text = st.one_of(st.sampled_from(NASTY), any_text, junk)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
PARAMS = {
    "refund": GOOD,
    "after_sales_ticket": {"ticket_id": "T1", "order_id": "A1042", "reason": "damaged"},
    "pickup": PICKUP,
    "ticket_cancel": {"ticket_id": "T1", "reason": "pickup_failed"},
}
field_values = st.one_of(
    json_values,
    st.sampled_from(NASTY),
    st.integers(-(10**20), 10**20),
    st.builds(  # day-shaped, with any script's digits, and months and days out of range
        "20{}-{:02d}-{:02d}".format,
        st.text(st.characters(categories=["Nd"]), min_size=2, max_size=2),
        st.integers(0, 13),
        st.integers(0, 32),
    ),
)


@st.composite
def bad_params(draw: st.DrawFn, kind: object) -> object:
    """The kind's sample params with fields changed, dropped or added; or not an object."""
    params = dict(PARAMS.get(str(kind), GOOD))
    if draw(st.booleans()):
        return draw(json_values)
    for name in draw(st.lists(st.sampled_from([*params, "extra"]), min_size=1, max_size=3)):
        if draw(st.booleans()):
            params.pop(name, None)
        else:
            params[name] = draw(field_values)
    return params


offsets = st.builds(timezone, st.timedeltas(timedelta(hours=-23), timedelta(hours=23)))
ROWS = ["none", "own", "other tenant's", "unstored", "rolled back", "junk"]
GOOD_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "tenant": st.sampled_from(["acme", "globex"]),
    "op_id": st.sampled_from(["op-9", "op-base"]) | st.from_regex(OP_ID_RE, fullmatch=True),
    "kind": st.sampled_from(sorted(PARAMS)),
    "run": st.sampled_from(ROWS[:2]),
    "correlation_id": st.none() | st.from_regex(CORRELATION_ID_RE, fullmatch=True),
    "compensates": st.sampled_from(ROWS[:2]),
    "max_attempts": st.none() | st.integers(1, 100),
    "deadline": st.none() | st.datetimes(datetime(2100, 1, 1), timezones=st.just(UTC) | offsets),
}
BAD_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "tenant": bad_text,
    "op_id": bad_text,
    "kind": bad_text,
    "run": st.sampled_from(ROWS[2:]),
    "correlation_id": bad_text,
    "compensates": st.sampled_from(ROWS[2:]),
    "max_attempts": st.integers(-3, 120) | st.integers(10**18, 10**30) | junk | any_text,
    "deadline": st.one_of(
        st.datetimes(datetime(2000, 1, 1), datetime.max, timezones=st.just(UTC) | offsets),
        st.datetimes(),  # naive
        st.builds(
            lambda dt, offset: dt.replace(tzinfo=OddTZ(offset)),
            st.datetimes(datetime(2000, 1, 1)),
            st.none() | st.timedeltas() | st.integers() | st.text(max_size=3),
        ),
        st.dates(),
        st.text(max_size=30),
        junk,
    ),
}
ARGS = [*GOOD_ARGS, "params"]


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_intake_is_a_typed_error_that_wrote_nothing_or_an_operation(
    engine: Engine, outbox: Outbox, data: st.DataObject
) -> None:
    # Mostly one bad argument with all the others good: a bad value reaches the database only
    # when nothing before it was refused.
    broken = data.draw(st.sets(st.sampled_from(ARGS), max_size=3), label="broken")
    args = {
        name: data.draw(BAD_ARGS[name] if name in broken else GOOD_ARGS[name], label=name)
        for name in GOOD_ARGS
    }
    kind = args["kind"]
    params = data.draw(
        bad_params(kind) if "params" in broken else st.just(PARAMS.get(str(kind), GOOD)),
        label="params",
    )
    with Session(engine) as s:
        base_run = runs.open_run(s, tenant="acme")
        base_op = enqueue(outbox, s, op_id="op-base", run=base_run).operation
        others_run = runs.open_run(s, tenant="globex")
        others_op = enqueue(outbox, s, tenant="globex", op_id="op-base").operation
        gone_run = runs.open_run(s, tenant="acme")
        s.expunge(gone_run)
        make_transient(gone_run)  # as after the rollback of its insert: an id, but no row
        rows: dict[str, tuple[object, object]] = {
            "none": (None, None),
            "own": (base_run, base_op),
            "other tenant's": (others_run, others_op),
            "unstored": (
                Run(tenant="acme", handle=runs.new_handle()),
                Operation(tenant="acme", op_id="op-x"),
            ),
            "rolled back": (gone_run, gone_run),
            "junk": ("run", 12),
        }
        args["run"] = rows[args["run"]][0]
        args["compensates"] = rows[args["compensates"]][1]

        def written() -> tuple[int, int]:
            return (
                int(s.scalar(select(func.count()).select_from(Operation)) or 0),
                int(s.scalar(select(func.count()).select_from(OperationEvent)) or 0),
            )

        before = written()
        try:
            got = outbox.enqueue(s, params=params, **args)
        except (InvalidInput, NotFound, IdempotencyConflict):
            # A typed error, and nothing written: not a row, not an event, nothing pending.
            # (Anything else, a SettledError of another class included, fails the test.)
            assert not s.new
            assert written() == before
        else:
            op = got.operation
            assert (op.tenant, op.op_id) == (args["tenant"], args["op_id"])
            if got.created:
                assert written() == (before[0] + 1, before[1] + 1)
                assert (op.kind, op.state) == (kind, "planned")
                assert op.correlation_id == args["correlation_id"]
                if args["deadline"] is not None:
                    assert op.deadline == args["deadline"]
                s.refresh(op)  # what the database holds reads back as what was accepted
                assert op.params == canonical_params(outbox.registry.get(kind).parse(params))
            else:
                assert written() == before
                assert op.id in (base_op.id, others_op.id)
        finally:
            s.rollback()
