"""Where a statement runs, whether the database answers, and running a step again on a
connection found dead."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, Select, literal_column, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

T = TypeVar("T")

PING: Select[tuple[Any]] = select(literal_column("1"))

#: Where a statement runs: a session's transaction, or a connection (a worker's step).
Bind = Session | Connection


def connection_of(bind: Bind) -> Connection:
    """The connection ``bind`` runs its statements on."""
    return bind.connection() if isinstance(bind, Session) else bind


def ping(bind: Bind) -> None:
    """One round trip to the database (``SELECT 1``); raises DBAPIError if it does not answer."""
    bind.execute(PING)


def run_twice(run: Callable[[], T]) -> T:
    """``run``, and once more if its pooled connection turned out to be dead.

    The engines have no pre-ping (it costs a round trip and a commit per checkout): a
    connection that died in the pool (PostgreSQL restarted) fails on its first statement and
    SQLAlchemy invalidates the pool; the second run gets a fresh connection. Only for work
    whose writes are all conditional and fenced: if the lost connection did commit, running
    it again changes nothing (a claim finds the lease taken, a transition finds the state
    moved on and is refused as stale).
    """
    try:
        return run()
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.warning("database connection lost; running the transaction again")
    return run()
