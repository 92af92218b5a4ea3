"""The refunds backend of ``examples/fastapi_refunds``, on SQLAlchemy's ``AsyncSession``.

Each ``POST /refunds`` writes the app's own business row (``refund_requests``) and the
operation intent (``AsyncOutbox.enqueue``) in ONE database transaction: both commit, or neither
does. The relay, installed on the ``async_sessionmaker``, publishes the wake-up hint after the
commit, never inside it. The client's ``Idempotency-Key`` header names its request: a
retransmission finds the stored request and returns the same operation (no new row, no second
send); the same key with another body is a 409, bad input a 422, and neither writes anything.

PostgreSQL only (``postgresql+psycopg://...``: psycopg's async driver, the same URL as the
workers'). The embedded SQLite default has no async driver among Settled's dependencies; the
synchronous example runs on it.

Run it (see README.md beside this file)::

    uvicorn --factory examples.fastapi_refunds_async.app:create_app
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    make_url,
    select,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from outbox import aio, relay
from outbox.db import upgrade
from outbox.errors import IdempotencyConflict, InvalidInput, InvalidSetting
from outbox.ids import new_op_id
from outbox.intake import Outbox
from outbox.settings import Settings

#: The app's own table: one row per refund a support agent filed.
metadata = MetaData()
refund_requests = Table(
    "refund_requests",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("request_key", String(64), nullable=False),
    Column("op_id", String(64), nullable=False),  # the Settled operation it created
    Column("order_id", String(64), nullable=False),
    Column("amount_minor", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("payee", String(64), nullable=False),
    UniqueConstraint("tenant", "request_key", name="uq_refund_requests_request"),
)

#: A client's request key (a UUID fits): kept as the operation's correlation id.
REQUEST_KEY = r"^[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,63}$"


class RefundIn(BaseModel):
    """The request body. Only its shape is checked here (strictly: "100" is not an amount);
    Settled's refund intent checks the rest (a positive amount in minor units, an upper-case
    ISO 4217 currency, well-formed references) and says what failed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    order_id: str
    amount_minor: int
    currency: str
    payee: str


def create_app(
    settings: Settings | None = None,
    *,
    publish: relay.Publish | None = None,
    tenant: str = "acme",
) -> FastAPI:
    """The app, built once. ``publish`` sends one hint message (default: to the Celery broker
    of ``settings``); a real app takes ``tenant`` from its own authentication.

    Raises InvalidSetting (``postgresql_only``) for a database other than PostgreSQL, before
    anything is created or written."""
    settings = settings or Settings()
    if make_url(settings.database_url).get_backend_name() != "postgresql":
        raise InvalidSetting(
            "this example runs on PostgreSQL only (postgresql+psycopg://...): the embedded "
            "SQLite default has no async driver among Settled's dependencies; "
            "examples/fastapi_refunds runs on it",
            code="postgresql_only",
            setting="SETTLED_DATABASE_URL",
        )
    upgrade(settings.database_url)  # Settled's tables (`settled db upgrade` does the same)
    # psycopg's async driver for the same URL; no statement's parameters in an error's text.
    engine = create_async_engine(settings.database_url, hide_parameters=True, pool_pre_ping=True)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    outbox = aio.AsyncOutbox(Outbox.from_settings(settings))
    refund = outbox.outbox.registry.get("refund")
    if publish is None:
        from settled.celery_app import create_app as celery_app
        from settled.celery_app import hint_publisher

        publish = hint_publisher(celery_app(settings))
    # Hints for the operations a transaction created, published once it commits (on the event
    # loop's thread: one broker round trip per committed request).
    relay.install(sessions, publish)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:  # the app's own table; a real app has migrations
            await conn.run_sync(metadata.create_all)
        yield
        await engine.dispose()  # its connections belong to this event loop

    app = FastAPI(title="Refunds, async (a Settled example)", lifespan=lifespan)

    @app.post("/refunds")
    async def file_refund(
        body: RefundIn,
        response: Response,
        request_key: Annotated[str, Header(alias="Idempotency-Key", pattern=REQUEST_KEY)],
    ) -> dict[str, Any]:
        """File a refund: the business row and the operation intent in one transaction."""
        params = body.model_dump()
        try:
            # The app's own transaction: committed here, before the answer is sent.
            async with sessions.begin() as session:
                filed = await file(session, request_key, params)
        except IdempotencyConflict as exc:  # this key was first used with another body
            raise HTTPException(409, {"code": exc.code, "message": exc.message}) from None
        except InvalidInput as exc:  # rolled back: neither row was written
            raise HTTPException(422, {"code": exc.code, "message": exc.message}) from None
        response.status_code = 201 if filed["created"] else 200
        return filed

    async def file(
        session: AsyncSession, request_key: str, params: dict[str, Any]
    ) -> dict[str, Any]:
        # Check the intent before writing anything (InvalidParams: a 422, nothing written).
        refund.parse(params)
        # Write first (INSERT ... ON CONFLICT DO NOTHING), then read: a retransmission, even
        # one racing the first request, finds the stored row instead of failing.
        inserted = await session.execute(
            insert(refund_requests)
            .on_conflict_do_nothing(index_elements=["tenant", "request_key"])
            .returning(refund_requests.c.op_id),
            {"tenant": tenant, "request_key": request_key, "op_id": new_op_id(), **params},
        )
        op_id = inserted.scalar_one_or_none()
        created = op_id is not None
        if op_id is None:
            stored = await session.execute(
                select(refund_requests.c.op_id).where(
                    refund_requests.c.tenant == tenant,
                    refund_requests.c.request_key == request_key,
                )
            )
            op_id = stored.scalar_one()
        # A replay with the same body returns the stored operation; with another body,
        # IdempotencyConflict, and the transaction rolls back.
        got = await outbox.enqueue(
            session,
            tenant=tenant,
            op_id=op_id,
            kind="refund",
            params=params,
            correlation_id=request_key,
        )
        return {
            "request_key": request_key,
            "op_id": got.op_id,
            "state": got.state,
            "created": created,
        }

    @app.get("/refunds/{request_key}")
    async def refund_status(request_key: str) -> dict[str, Any]:
        """The refund request and where its operation stands (done, not done, uncertain)."""
        async with sessions() as session:
            found = await session.execute(
                select(refund_requests).where(
                    refund_requests.c.tenant == tenant,
                    refund_requests.c.request_key == request_key,
                )
            )
            row = found.mappings().one_or_none()
            if row is None:
                raise HTTPException(404, {"code": "refund_not_found"})
            operation = await aio.operation_status(session, tenant, row["op_id"])
        request = {k: row[k] for k in ("request_key", "order_id", "amount_minor", "currency")}
        return {"request": request, "operation": operation}

    return app
