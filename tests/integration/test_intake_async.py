"""The runs API from async code (``outbox.aio``) and the async relay's scope, against real
PostgreSQL through SQLAlchemy's async engine (psycopg's async driver). The intake contract of
the async door (replay, conflict, tenants, bad input, rollback, hints after commit, statements,
a real worker) is asserted with every other door's in ``test_intake_doors.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import aio
from outbox.errors import NotFound
from outbox.intake import Outbox
from tests.support.doors import AsyncSessionDoor

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
INTENT: dict[str, Any] = {"tenant": "acme", "op_id": "op-9", "kind": "refund", "params": GOOD}


@pytest.fixture
def door(pg: Engine, pg_url: str, outbox: Outbox) -> Iterator[AsyncSessionDoor]:
    opened = AsyncSessionDoor(pg_url, outbox)
    yield opened
    opened.close()


def test_the_runs_api_from_async_code(door: AsyncSessionDoor) -> None:
    async def work() -> tuple[Any, ...]:
        async with door.sessions.begin() as session:
            run = await aio.open_run(session, tenant="acme", title="After-sales for A1042")
            got = await door.aio.enqueue(session, **INTENT, run=run)
            handle = run.handle
        async with door.sessions() as session:
            status = await aio.operation_status(session, "acme", got.op_id)
            before = await aio.run_report(session, "acme", handle)
        async with door.sessions.begin() as session:
            cancelled = await aio.cancel_run(session, "acme", handle, actor="app")
            flagged = cancelled.run.cancel_requested_at is not None
        async with door.sessions() as session:
            after = await aio.run_report(session, "acme", handle)
            with pytest.raises(NotFound):
                await aio.find_run(session, "globex", handle)  # another tenant's: not found
        return got, status, before, cancelled, flagged, after

    got, status, before, cancelled, flagged, after = door.run(work())
    assert (status["state"], status["group"], status["run"]) == (
        "planned",
        "not_done",
        after.handle,
    )
    assert (before.line(got.op_id).message, before.cancelled) == ("planned", False)
    assert list(cancelled.cancelled_ids) == [got.id] and flagged
    assert (after.line(got.op_id).message, after.cancelled) == ("cancelled", True)


def test_the_relay_of_an_async_sessionmaker_hears_its_own_sessions_only(
    door: AsyncSessionDoor, pg: Engine, outbox: Outbox
) -> None:
    with door.begin() as tx:
        async_id = tx.enqueue(**{**INTENT, "op_id": "op-async"}).id
        tx.commit()
    with Session(pg) as s, s.begin():  # another app's session: not this relay's to hint
        outbox.enqueue(s, **{**INTENT, "op_id": "op-sync"})
    assert door.hints == [[async_id]]
