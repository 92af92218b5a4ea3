"""Intake and the runs API from async code: the same calls on an ``AsyncSession``.

An app on FastAPI (or any asyncio code) with SQLAlchemy's ``AsyncSession`` enqueues in its own
transaction the way a synchronous app does::

    outbox = AsyncOutbox(Outbox.from_settings(settings))
    install_relay(sessions, hint_publisher(app))  # sessions: an async_sessionmaker
    async with sessions.begin() as session:
        session.add(RefundRequest(order_id="A1042"))
        got = await outbox.enqueue(session, tenant="acme", op_id=new_op_id(), ...)
    # committed: the row and the intent together; the hint is on its way

Each call runs the synchronous one on the session's own connection through SQLAlchemy's
bridge (``AsyncSession.run_sync``: the statements go through the async driver, on the event
loop), so the validation, the fingerprint, the replay check and the one intake statement are
the intake core's (``outbox.intake``), unchanged, with the same typed errors, and nothing is
committed. ``outbox.relay.install`` takes an ``async_sessionmaker`` (or an ``AsyncSession``)
and publishes the hints of its transactions after they commit; a rollback publishes nothing.

``Enqueued.operation`` reads the entity with the synchronous session and cannot be used from
async code: read it with ``await session.get(Operation, got.id)`` when the whole row is wanted.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import runs
from outbox.intake import Enqueued, Outbox
from outbox.models import Operation, Run
from outbox.report import Report


class AsyncOutbox:
    """``Outbox.enqueue`` for an ``AsyncSession``: the same arguments, the same answers."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    async def enqueue(
        self,
        session: AsyncSession | AsyncConnection,
        *,
        tenant: str,
        op_id: str,
        kind: str,
        params: Mapping[str, Any],
        run: Run | None = None,
        correlation_id: str | None = None,
        compensates: Operation | None = None,
        max_attempts: int | None = None,
        deadline: datetime | None = None,
    ) -> Enqueued:
        """Record an operation intent in ``session``'s transaction (never committed): what
        ``Outbox.enqueue`` does, with its errors. ``session``: an ``AsyncSession`` (the relay
        hints after its commit), or an ``AsyncConnection`` (the app publishes the hint after
        committing: ``outbox.relay.publish_hints``)."""
        return await session.run_sync(
            lambda sync: self.outbox.enqueue(
                sync,
                tenant=tenant,
                op_id=op_id,
                kind=kind,
                params=params,
                run=run,
                correlation_id=correlation_id,
                compensates=compensates,
                max_attempts=max_attempts,
                deadline=deadline,
            )
        )


async def open_run(session: AsyncSession, *, tenant: str, title: str | None = None) -> Run:
    """``outbox.runs.open_run`` in ``session``'s transaction."""
    return await session.run_sync(lambda sync: runs.open_run(sync, tenant=tenant, title=title))


async def find_run(session: AsyncSession, tenant: str, handle: str) -> Run:
    """``outbox.runs.find_run``: the run, or NotFound."""
    return await session.run_sync(lambda sync: runs.find_run(sync, tenant, handle))


async def cancel_run(
    session: AsyncSession, tenant: str, handle: str, *, actor: str
) -> runs.Cancelled:
    """``outbox.runs.cancel_run`` in ``session``'s transaction (the caller commits); its run
    read again, as an expired row cannot be read from async code."""

    def cancel(sync: Session) -> runs.Cancelled:
        done = runs.cancel_run(sync, tenant, handle, actor=actor)
        sync.refresh(done.run)
        return done

    return await session.run_sync(cancel)


async def run_report(session: AsyncSession, tenant: str, handle: str) -> Report:
    """``outbox.runs.run_report``: done / not done / uncertain, with evidence."""
    return await session.run_sync(lambda sync: runs.run_report(sync, tenant, handle))


async def operation_status(session: AsyncSession, tenant: str, op_id: str) -> dict[str, Any]:
    """``outbox.runs.operation_status``: one operation's state, in the report's words."""
    return await session.run_sync(lambda sync: runs.operation_status(sync, tenant, op_id))


async def compensate(
    outbox: AsyncOutbox,
    session: AsyncSession,
    original: Operation,
    *,
    op_id: str,
    kind: str,
    params: Mapping[str, Any],
    correlation_id: str | None = None,
) -> Enqueued:
    """``outbox.runs.compensate``: a new operation that offsets ``original``."""
    return await session.run_sync(
        lambda sync: runs.compensate(
            outbox.outbox,
            sync,
            original,
            op_id=op_id,
            kind=kind,
            params=params,
            correlation_id=correlation_id,
        )
    )
