"""Storage: every SQL statement of the core, by concern, behind one database seam.

=================  ==================================================================
module             what it holds
=================  ==================================================================
``claims``         the claim UPDATEs (lease + fencing version), lease renewal, due ids
``transitions``    the values the one writer takes: ``Transition`` (a fenced state
                   change with its event row), ``Note`` (an event that changes
                   nothing), ``Finish`` (what came back for an attempt)
``database``       ``Storage``: the one writer of transitions and event rows, the intake
                   INSERT and a worker's step, implemented by ``postgres`` and ``sqlite``
``attempts``       starting sends, attempt history, the reconciler's quiescence facts
``reviews``        review items: open ones, resolving, staff settling an operation
``runs``           finding a run, its operations, its cancel flag, cancelling them
``operations``     reads of operation rows, the database's clock, the intake INSERT
``events``         reads of the audit trail (event rows)
``prune``          terminal operations nothing holds; deleting them with their rows
``metrics``        what a metrics scrape reads (live gauges, event counters by id range)
``apikeys``        the status API's keys: adding one, the live key of an id, revoking
``staff_accounts`` the console's staff accounts, sessions and failed sign-ins (hashes only)
``traces``         an operation's trace context (``operations.trace_context``)
``clock_steps``    steps of the database's clock a process saw, the newest one's end
``waking``         operations waiting after refusals: waking a bounded batch of them when
                   their downstream is back, the recovery probe's target
``schema``         the migrations (Alembic revisions) a database is at
``borrowed``       intake on the app's own connection: a Session over a SQLAlchemy
                   Connection, or over a psycopg 3 / sqlite3 connection it never begins,
                   commits, rolls back, closes or configures (``outbox.borrowed``)
``connection``     where a statement runs, the health check's ping, running a step again
``queries.sql``    the hand-written PostgreSQL statements, by name
=================  ==================================================================

Callers choose the database once: ``storage_for(engine)`` gives the ``Storage`` of an
engine (``PostgresStorage`` or ``SqliteStorage``); nothing outside this package looks at the
dialect. Every state change and every event row is written by ``Storage.write_transitions``,
and nothing else.

How SQL is held here (two ways, and only these):

1. **SQLAlchemy statements built once, at import, as module constants** (upper-case names:
   ``CLAIM_DUE``, ``CLOSE_REVIEWS``), with named ``bindparam`` values given at execution.
   Core for most; an ORM ``select(Model)`` where the caller wants loaded objects. A statement
   is never built per call: SQLAlchemy then compiles each once per dialect and caches it. A
   query whose shape depends on a caller's filters is built by a named function from module
   constants.
2. **Hand-written PostgreSQL** where one statement must do what Core cannot say (a batch of
   transitions with their event, review and attempt rows, in one round trip): named, static
   SQL in ``queries.sql``, loaded by name at import (``postgres.QUERIES``), values as bound
   parameters only (a batch as one JSON array parameter), never formatted into the text.

Database time is ``outbox.db.db_now`` in Core and ``clock_timestamp()`` in ``queries.sql``.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.storage.database import Storage
from outbox.storage.postgres import PostgresStorage
from outbox.storage.sqlite import SqliteStorage

__all__ = ["PostgresStorage", "SqliteStorage", "Storage", "storage_for"]

_IMPLEMENTATIONS: dict[str, type[Storage]] = {
    "postgresql": PostgresStorage,
    "sqlite": SqliteStorage,
}


def storage_for(bind: Engine | Connection | Session | sessionmaker[Session]) -> Storage:
    """The Storage of ``bind``'s engine (a small object: callers may keep it or ask again)."""
    source = bind.kw["bind"] if isinstance(bind, sessionmaker) else bind
    if isinstance(source, Session):
        source = source.get_bind()
    engine: Engine = source.engine if isinstance(source, Connection) else source
    try:
        implementation = _IMPLEMENTATIONS[engine.dialect.name]
    except KeyError:
        raise ValueError(f"Settled does not support {engine.dialect.name!r}") from None
    return implementation(engine)
