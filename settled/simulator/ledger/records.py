"""The idempotency records: one per (tenant, key), holding the saved answer and the outcome.

A key in flight is marked in memory, not in the database: a request in flight lives only as
long as this process, and nothing it did is committed before its result is saved (execution
and result commit together), so after a restart the key is rightly free again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine.interfaces import DBAPICursor

from settled.simulator.ledger.statements import Database, run
from settled.simulator.messages import Response


@dataclass(frozen=True)
class Record:
    """What the ledger knows of a key: in flight, or done with its saved answer and outcome."""

    fingerprint: str
    state: str  # in_flight | done
    created: float
    response: Response | None
    outcome: Mapping[str, Any] | None  # the record the lookup answers with


@dataclass(frozen=True)
class _Mark:
    """A key in flight: its request is between the idempotency check and its saved result."""

    fingerprint: str
    created: float


class Records:
    """Reads and writes of the idempotency records (under the database's lock)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._in_flight: dict[tuple[str, str], _Mark] = {}

    def get(self, tenant: str, key: str, *, not_before: float | None) -> Record | None:
        """The record of ``key``; None if absent or created before ``not_before`` (forgotten)."""
        db = self._db
        with db.lock:
            mark = self._in_flight.get((tenant, key))
            if mark is not None:
                if not_before is not None and mark.created < not_before:
                    return None
                return Record(mark.fingerprint, "in_flight", mark.created, None, None)
            with db.transaction() as cur:
                row = run(cur, db.sql.record, tenant=tenant, key=key).fetchone()
        if row is None:
            return None
        fp, state, created, status, body, headers, outcome = row
        if not_before is not None and created < not_before:
            return None
        response = None
        if status is not None:
            response = Response(status, json.loads(body), json.loads(headers))
        return Record(fp, state, created, response, json.loads(outcome) if outcome else None)

    def begin(self, tenant: str, key: str, fingerprint: str, now: float) -> None:
        """Mark ``key`` in flight (replacing a forgotten or unsaved record)."""
        with self._db.lock:
            self._in_flight[(tenant, key)] = _Mark(fingerprint, now)

    def end(self, tenant: str, key: str) -> None:
        """``key`` is no longer in flight (its result was saved, or its execution failed)."""
        with self._db.lock:
            self._in_flight.pop((tenant, key), None)

    def forget(self, tenant: str, key: str) -> None:
        """Drop the record of ``key`` (a request that ended before executing saves nothing)."""
        db = self._db
        with db.transaction() as cur:
            self._in_flight.pop((tenant, key), None)
            run(cur, db.sql.record_delete, tenant=tenant, key=key)

    def save(
        self,
        cur: DBAPICursor,
        *,
        tenant: str,
        key: str,
        fingerprint: str,
        now: float,
        response: Response,
        outcome: Mapping[str, Any] | None,
    ) -> None:
        """Save the result of ``key`` in the transaction of ``cur`` (one record per key);
        ``outcome`` None: an answer saved with nothing executed (no record to look up)."""
        saved = json.dumps(outcome) if outcome is not None else None
        values = {
            "tenant": tenant,
            "key": key,
            "fp": fingerprint,
            "state": "done",
            "now": now,
            "status": response.status,
            "body": saved if response.body is outcome else json.dumps(response.body),
            "headers": json.dumps(dict(response.headers)),
            "outcome": saved,
        }
        sql = self._db.sql
        if run(cur, sql.record_update, **values).rowcount == 0:
            run(cur, sql.record_insert, **values)

    def in_flight(self, cur: DBAPICursor) -> list[dict[str, str]]:
        """The keys in flight, in the transaction of ``cur``."""
        # Records of older ledgers may still say "in_flight": such a key stays in use.
        rows = run(cur, self._db.sql.records_in_flight).fetchall()
        marks = list(self._in_flight)
        keys = [(str(tenant), str(key)) for tenant, key in rows]
        keys += [mark for mark in marks if mark not in keys]
        return [{"tenant": tenant, "idempotency_key": key} for tenant, key in keys]

    def clear_marks(self) -> None:
        """Forget every key in flight (the ledger was reset)."""
        with self._db.lock:
            self._in_flight.clear()
