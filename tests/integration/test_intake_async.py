"""Intake and the runs API from async code (``outbox.aio``), against real PostgreSQL through
SQLAlchemy's async engine (psycopg's async driver): the same contract as the synchronous door
(``test_intake.py``), and the hints after commit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

from outbox import aio, relay
from outbox.errors import IdempotencyConflict, InvalidIdentifier, InvalidParams, NotFound
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
T = TypeVar("T")

business = MetaData()
refund_requests = Table(
    "refund_requests_async",
    business,
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64)),
)


class Door:
    """An async engine on the test database, its sessions with the relay installed, and the
    hints the relay published."""

    def __init__(self, url: str, outbox: Outbox) -> None:
        self.url = url
        self.outbox = aio.AsyncOutbox(outbox)
        self.hints: list[list[int]] = []
        self.statements: list[str] = []

    def run(self, work: Callable[[Door, async_sessionmaker[AsyncSession]], Awaitable[T]]) -> T:
        async def main() -> T:
            engine = create_async_engine(self.url)
            event.listen(engine.sync_engine, "before_cursor_execute", self._keep)
            sessions = async_sessionmaker(engine, expire_on_commit=False)
            relay.install(sessions, self._publish)
            try:
                return await work(self, sessions)
            finally:
                await engine.dispose()

        return asyncio.run(main())

    def _keep(self, _c: Any, _cur: Any, statement: str, *_: Any) -> None:
        self.statements.append(statement.split(None, 1)[0])

    def _publish(self, ids: Sequence[int]) -> None:
        self.hints.append(list(ids))

    async def enqueue(self, session: AsyncSession, **kw: Any) -> Any:
        args: dict[str, Any] = {"tenant": "acme", "op_id": "op-9", "kind": "refund", "params": GOOD}
        args.update(kw)
        return await self.outbox.enqueue(session, **args)


@pytest.fixture
def door(pg: Engine, pg_url: str, outbox: Outbox) -> Iterator[Door]:
    business.create_all(pg)
    try:
        yield Door(pg_url, outbox)
    finally:
        business.drop_all(pg)


def rows(engine: Engine, model: Any = Operation) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def test_an_intent_commits_with_the_business_row_and_is_hinted_after_commit(
    door: Door, pg: Engine
) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> tuple[Any, list[Any]]:
        async with sessions.begin() as session:
            await session.execute(refund_requests.insert().values(order_id="A1042"))
            got = await d.enqueue(session, correlation_id="call-1")
            hinted_inside = list(d.hints)  # nothing before the commit
        return got, hinted_inside

    got, inside = door.run(work)
    assert got.created and (got.tenant, got.op_id, got.state) == ("acme", "op-9", "planned")
    assert inside == [] and door.hints == [[got.id]]
    assert (rows(pg), rows(pg, refund_requests), rows(pg, OperationEvent)) == (1, 1, 1)


def test_a_rollback_leaves_no_row_and_no_hint(door: Door, pg: Engine) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> None:
        async with sessions() as session:
            await session.execute(refund_requests.insert().values(order_id="A1042"))
            await d.enqueue(session)
            await session.rollback()

    door.run(work)
    assert (rows(pg), rows(pg, refund_requests), rows(pg, OperationEvent)) == (0, 0, 0)
    assert door.hints == []


def test_a_new_intent_is_one_statement_a_replay_two(door: Door) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> list[list[str]]:
        seen = []
        for _ in range(2):
            async with sessions.begin() as session:
                d.statements.clear()
                await d.enqueue(session)
                seen.append(list(d.statements))
        return seen

    new, replay = door.run(work)
    assert (new, replay) == (["WITH"], ["WITH", "SELECT"])
    assert len(door.hints) == 1  # the replay's transaction created nothing


def test_replay_conflict_and_tenants(door: Door, pg: Engine) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> tuple[Any, ...]:
        async with sessions.begin() as session:
            first = await d.enqueue(session)
        async with sessions.begin() as session:
            again = await d.enqueue(session, params=dict(reversed(list(GOOD.items()))))
        async with sessions.begin() as session:
            other = await d.enqueue(session, tenant="globex")
        async with sessions() as session:
            with pytest.raises(IdempotencyConflict):
                await d.enqueue(session, params={**GOOD, "amount_minor": 1})
            await session.rollback()
        return first, again, other

    first, again, other = door.run(work)
    assert first.created and not again.created and again.id == first.id
    assert other.created and other.id != first.id and other.tenant == "globex"
    assert rows(pg) == 2
    assert door.hints == [[first.id], [other.id]]  # a replay hints nothing


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"op_id": "has space"}, InvalidIdentifier),
        ({"params": {**GOOD, "amount_minor": -1}}, InvalidParams),
        ({"tenant": ""}, InvalidIdentifier),
    ],
)
def test_bad_input_is_a_typed_error_and_writes_nothing(
    door: Door, pg: Engine, bad: dict[str, Any], error: type[Exception]
) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> None:
        async with sessions.begin() as session:
            await d.enqueue(session, **bad)

    with pytest.raises(error):
        door.run(work)
    assert (rows(pg), rows(pg, OperationEvent), door.hints) == (0, 0, [])


def test_the_runs_api_from_async_code(door: Door) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> tuple[Any, ...]:
        async with sessions.begin() as session:
            run = await aio.open_run(session, tenant="acme", title="After-sales for A1042")
            got = await d.enqueue(session, run=run)
            handle = run.handle
        async with sessions() as session:
            status = await aio.operation_status(session, "acme", got.op_id)
            before = await aio.run_report(session, "acme", handle)
        async with sessions.begin() as session:
            cancelled = await aio.cancel_run(session, "acme", handle, actor="app")
            flagged = cancelled.run.cancel_requested_at is not None
        async with sessions() as session:
            after = await aio.run_report(session, "acme", handle)
            with pytest.raises(NotFound):
                await aio.find_run(session, "globex", handle)  # another tenant's: not found
        return got, status, before, cancelled, flagged, after

    got, status, before, cancelled, flagged, after = door.run(work)
    assert (status["state"], status["group"], status["run"]) == (
        "planned",
        "not_done",
        after.handle,
    )
    assert (before.line(got.op_id).message, before.cancelled) == ("planned", False)
    assert list(cancelled.cancelled_ids) == [got.id] and flagged
    assert (after.line(got.op_id).message, after.cancelled) == ("cancelled", True)


def test_the_relay_of_an_async_sessionmaker_hears_its_own_sessions_only(
    door: Door, pg: Engine, outbox: Outbox
) -> None:
    async def work(d: Door, sessions: async_sessionmaker[AsyncSession]) -> int:
        async with sessions.begin() as session:
            got = await d.enqueue(session, op_id="op-async")
        return int(got.id)

    async_id = door.run(work)
    with Session(pg) as s, s.begin():  # another app's session: not this relay's to hint
        outbox.enqueue(s, tenant="acme", op_id="op-sync", kind="refund", params=GOOD)
    assert door.hints == [[async_id]]
