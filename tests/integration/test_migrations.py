"""Migrations: 0003 adds the attempts' send bound and settles review items left open by an
operation that had already left ``unknown`` (which nobody could close)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Table, insert, inspect, select, text, update
from sqlalchemy.orm import Session

from outbox.db import alembic_config, make_engine, upgrade
from outbox.intake import Outbox
from outbox.models import Base, Operation, ReviewItem
from tests.support import services
from tests.support.contend import DEADLINE, contender
from tests.support.rig import GOOD

ops: Table = Operation.__table__  # type: ignore[assignment]
ITEM = (
    "INSERT INTO review_items (operation_id, tenant, reason, evidence, version)"
    " VALUES (:id, 'acme', 'lookup_unavailable', '{}', 1)"
)


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no tables yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.sqlite3'}"
        return
    server = request.getfixturevalue("pg_server")
    with services.throwaway_database(server, f"settled_m_{uuid.uuid4().hex[:8]}") as url:
        yield url


def write_operation(s: Session, op_id: str, amount_minor: int = 10000) -> int:
    """A planned operation written as the app's intake of that schema did (today's intake
    reads tables of later migrations: the tombstones of 0011); its id."""
    now = datetime.now(UTC)
    values = {
        "tenant": "acme", "op_id": op_id, "kind": "refund",
        "params": {**GOOD, "amount_minor": amount_minor}, "fingerprint": "f" * 64,
        "fingerprint_key_version": "v1", "idempotency_key": f"key-{op_id}", "max_attempts": 5,
        "deadline": now + timedelta(hours=1), "next_attempt_at": now,
    }  # fmt: skip
    return int(s.execute(insert(ops).values(**values).returning(ops.c.id)).scalar_one())


def test_0003_closes_review_items_whose_operation_left_unknown(empty_url: str) -> None:
    upgrade(empty_url, "0002")
    engine = make_engine(empty_url)
    states = {"op-1": "succeeded", "op-2": "unknown", "op-3": "planned"}
    try:
        ids = {}
        with Session(engine) as s, s.begin():
            for n, (op_id, state) in enumerate(states.items()):
                ids[op_id] = write_operation(s, op_id, 100 + n)
                s.execute(update(Operation).where(Operation.id == ids[op_id]).values(state=state))
                s.execute(text(ITEM), {"id": ids[op_id]})
        upgrade(empty_url)
        columns = select(
            ReviewItem.operation_id,
            ReviewItem.resolved_at,
            ReviewItem.resolved_by,
            ReviewItem.version,
        )
        with engine.connect() as conn:
            items = {row.operation_id: row for row in conn.execute(columns)}
            attempt_columns = {c["name"] for c in inspect(conn).get_columns("attempts")}
        assert items[ids["op-2"]].resolved_at is None  # still unknown: still in review
        for op_id in ("op-1", "op-3"):
            row = items[ids[op_id]]
            assert row.resolved_at is not None
            assert (row.resolved_by, row.version) == ("migration:0003", 2)
        assert "not_after" in attempt_columns
    finally:
        engine.dispose()


def test_upgrade_waits_for_a_writer_instead_of_failing(empty_url: str) -> None:
    """`settled db upgrade` while the app writes: the migration reads where it is, the app
    commits, the migration writes. On SQLite it failed there ("database is locked" at once,
    the busy timeout never applied); it must wait its turn and finish."""
    upgrade(empty_url, "0006")
    engine = make_engine(empty_url)
    try:
        with contender(lambda: upgrade(empty_url)) as migration:
            with Session(engine) as s, s.begin():
                op = write_operation(s, "op-1")
                migration.start()
                assert migration.started.wait(DEADLINE)
            migration.result()
        with engine.connect() as conn:
            proposal_columns = {c["name"] for c in inspect(conn).get_columns("proposals")}
            stored = conn.scalar(select(Operation.op_id).where(Operation.id == op))
        assert "compensates_id" in proposal_columns  # 0007 applied
        assert stored == "op-1"
    finally:
        engine.dispose()


def test_0011_adds_the_tombstones_and_takes_them_away_again(empty_url: str, outbox: Outbox) -> None:
    upgrade(empty_url, "0010")
    engine = make_engine(empty_url)
    try:
        with Session(engine) as s, s.begin():
            write_operation(s, "op-1")
        upgrade(empty_url)
        with Session(engine) as s, s.begin():  # today's intake, on the migrated database
            assert not outbox.enqueue(s, tenant="acme", op_id="op-2", kind="refund",
                                      params=GOOD).pruned  # fmt: skip
        with engine.connect() as conn:
            assert inspect(conn).has_table("operation_tombstones")
        command.downgrade(alembic_config(empty_url), "0010")
        with engine.connect() as conn:
            assert not inspect(conn).has_table("operation_tombstones")
            if engine.dialect.name == "postgresql":
                found = "SELECT count(*) FROM pg_proc WHERE proname = 'settled_tombstoned'"
                assert conn.scalar(text(found)) == 0
            assert conn.scalar(select(Operation.op_id).where(Operation.op_id == "op-1")) == "op-1"
    finally:
        engine.dispose()


def test_0011_makes_the_tombstones_table_the_model_describes(empty_url: str) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diffs = [d for d in compare_metadata(context, Base.metadata)
                     if "operation_tombstones" in repr(d)]  # fmt: skip
        assert diffs == []
    finally:
        engine.dispose()


def test_0013_adds_the_search_indexes_and_takes_them_away_again(empty_url: str) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    plain = {"ix_operations_downstream_ref", "ix_operations_idempotency_key", "ix_operations_op_id"}
    expressions = {
        "ix_operations_order_id",
        "ix_operations_payee",
        "ix_attempts_reference",
        "ix_operation_events_reference",
        "ix_operation_events_record_reference",
    }
    names = "SELECT indexname FROM pg_indexes WHERE indexname LIKE 'ix_%'"
    try:
        with engine.connect() as conn:
            found = {i["name"] for i in inspect(conn).get_indexes("operations")}
            if engine.dialect.name == "postgresql":
                assert expressions <= set(conn.scalars(text(names)))
        assert plain <= found
        command.downgrade(alembic_config(empty_url), "0012")
        with engine.connect() as conn:
            found = {i["name"] for i in inspect(conn).get_indexes("operations")}
            if engine.dialect.name == "postgresql":
                assert not expressions & set(conn.scalars(text(names)))
        assert not plain & found
        upgrade(empty_url)
    finally:
        engine.dispose()
