"""The runs API and operation status from Django code, on Django's connection: thin wrappers
of ``outbox.runs`` through ``outbox.borrowed.session_for``.

What writes (``open_run``, ``cancel_run``, ``compensate``) runs in the caller's
``transaction.atomic()`` block, like ``enqueue``, and is refused outside one. What reads
(``find_run``, ``run_report``, ``operation_status``) runs anywhere: in the caller's block if it
is in one, else in a read-only transaction of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import connections, transaction
from sqlalchemy.orm import Session

from outbox import runs
from outbox.borrowed import session_for
from outbox.errors import InvalidIdentifier, NotFound
from outbox.ids import validate_op_id, validate_tenant
from outbox.intake import Enqueued
from outbox.models import Operation, Run
from outbox.report import Report
from outbox.storage.operations import find_operation as stored_operation
from settled.contrib.django.database import connection_in_atomic
from settled.contrib.django.intake import hint_after_commit, outbox


@contextmanager
def session(using: str = "default") -> Iterator[Session]:
    """A SQLAlchemy ``Session`` on Django's connection ``using``: in the caller's atomic block
    if it is in one (nothing committed or rolled back here), else in an atomic block of its
    own around the ``with`` (committed at its end, rolled back on an error)."""
    if connections[using].in_atomic_block:
        with session_for(connection_in_atomic(using)) as own:
            yield own
        return
    with transaction.atomic(using=using), session_for(connection_in_atomic(using)) as own:
        yield own


@contextmanager
def _writing(using: str) -> Iterator[Session]:
    """A ``Session`` in the caller's atomic block; InvalidInput (``no_transaction``) outside."""
    with session_for(connection_in_atomic(using)) as own:
        yield own


def open_run(*, tenant: str, title: str | None = None, using: str = "default") -> Run:
    """``outbox.runs.open_run`` in the current atomic block: pass it to ``enqueue(run=...)``;
    its ``handle`` is what the user is given."""
    with _writing(using) as own:
        return runs.open_run(own, tenant=tenant, title=title)


def find_run(tenant: str, handle: str, *, using: str = "default") -> Run:
    """``outbox.runs.find_run``: the run, or NotFound (another tenant's handle too)."""
    with session(using) as own:
        return runs.find_run(own, tenant, handle)


def cancel_run(tenant: str, handle: str, *, actor: str, using: str = "default") -> runs.Cancelled:
    """``outbox.runs.cancel_run`` in the current atomic block: planned operations become
    cancelled when it commits; those already sent stay as they are."""
    with _writing(using) as own:
        done = runs.cancel_run(own, tenant, handle, actor=actor)
        own.refresh(done.run)
        return done


def compensate(
    *,
    tenant: str,
    original: str,
    op_id: str,
    kind: str,
    params: Mapping[str, Any],
    correlation_id: str | None = None,
    using: str = "default",
) -> Enqueued:
    """``outbox.runs.compensate`` in the current atomic block: a new operation ``op_id`` that
    offsets ``tenant``'s operation ``original`` (its op_id, read in this transaction; NotFound
    for one the tenant does not have), hinted once the block commits."""
    with _writing(using) as own:
        got = runs.compensate(
            outbox(using),
            own,
            _operation(own, tenant, original),
            op_id=op_id,
            kind=kind,
            params=params,
            correlation_id=correlation_id,
        )
    if got.created and got.id is not None:
        hint_after_commit([got.id], using=using)
    return got


def find_operation(tenant: str, op_id: str, *, using: str = "default") -> Operation:
    """The operation ``op_id`` of ``tenant``, read now (a row detached from any session), or
    NotFound: what ``Enqueued.operation`` gives on a ``Session``."""
    with session(using) as own:
        return _operation(own, tenant, op_id)


def _operation(own: Session, tenant: str, op_id: str) -> Operation:
    """NotFound, before any SQL, for an op_id that could never have been stored (as
    ``operation_status``)."""
    tenant = validate_tenant(tenant)
    try:
        op_id = validate_op_id(op_id)
    except InvalidIdentifier:
        raise NotFound("no such operation", code="operation_not_found") from None
    found = stored_operation(own, tenant, op_id)
    if found is None:
        raise NotFound("no such operation", code="operation_not_found")
    return found


def run_report(tenant: str, handle: str, *, using: str = "default") -> Report:
    """``outbox.runs.run_report``: the run's done / not done / uncertain, with evidence."""
    with session(using) as own:
        return runs.run_report(own, tenant, handle)


def operation_status(tenant: str, op_id: str, *, using: str = "default") -> dict[str, Any]:
    """``outbox.runs.operation_status``: one operation's state in the report's words (a
    JSON-ready dict), or NotFound for an op_id this tenant does not have."""
    with session(using) as own:
        return runs.operation_status(own, tenant, op_id)
