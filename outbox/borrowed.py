"""Intake on a connection the app owns: the names an app (or a framework's door) uses.

``Outbox.enqueue`` takes, besides a ``Session``, a SQLAlchemy ``Connection`` or the app's own
psycopg 3 or sqlite3 connection, and writes in the transaction open there; ``session_for``
gives the runs API a ``Session`` in that transaction. The code is
``outbox.storage.borrowed`` (it tells the drivers apart, which only storage does); its
docstring says what is refused and what is never done to the app's connection.
"""

from __future__ import annotations

from outbox.storage.borrowed import (
    BorrowedPsycopg,
    BorrowedSQLite,
    Door,
    borrowed,
    in_transaction,
    read,
    session_for,
    session_on,
)

__all__ = [
    "BorrowedPsycopg",
    "BorrowedSQLite",
    "Door",
    "borrowed",
    "in_transaction",
    "read",
    "session_for",
    "session_on",
]
