"""Intake from Django code: ``enqueue`` writes the intent on Django's own connection, inside
the ``transaction.atomic()`` block the view is in, and its hint goes out through
``transaction.on_commit``: a rollback publishes nothing.

The outbox comes from the composition root (``settled.runtime``), one runtime per database built
once per process from Settled's settings (``SETTLED_*``) with the database taken from Django's
``DATABASES`` (``settled_database_url``), so that the app's intake is the worker's (the same
kinds, the contracts the settings apply to them); the hint publisher is built once from the
settings too. ``configure`` puts others in their place (a test's list of hints, an outbox with
kinds of the app's own).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction

from outbox.errors import InvalidSetting
from outbox.intake import Enqueued, Outbox
from outbox.models import Operation, Run
from outbox.relay import Publish, publish_hints
from outbox.settings import Settings, masked
from settled.contrib.django.database import (
    connection_in_atomic,
    same_database,
    settled_database_url,
)

if TYPE_CHECKING:
    from settled.runtime import Runtime

_lock = threading.Lock()
_runtimes: dict[str, Runtime] = {}
_given: dict[str, Outbox] = {}
_publish: list[Publish] = []


def configure(*, outbox: Outbox | None = None, publish: Publish | None = None) -> None:
    """Use ``outbox`` for every database, and ``publish`` for the hints (one message of these
    operation ids; a broker error is logged by ``publish_hints``, never raised into the app).
    None for either: built from the settings on first use, as when never configured (the
    runtimes built before are closed)."""
    with _lock:
        built = list(_runtimes.values())
        _runtimes.clear()
        _publish.clear()
        _given.clear()
        if outbox is not None:
            _given["outbox"] = outbox
        if publish is not None:
            _publish.append(publish)
    for old in built:
        old.close()


def settings_for(using: str = "default") -> Settings:
    """Settled's settings (``SETTLED_*``) with ``database_url`` Django's ``DATABASES[using]``.

    Raises InvalidSetting (``database_mismatch``) when ``SETTLED_DATABASE_URL`` is set and
    names another database: a worker started with it would never see the app's intents.
    """
    read = Settings()
    url = settled_database_url(using)
    if "database_url" in read.model_fields_set and not same_database(read.database_url, url):
        raise InvalidSetting(
            f"SETTLED_DATABASE_URL ({masked(read.database_url)}) is not Django's "
            f"DATABASES[{using!r}] ({masked(url)}): set it from "
            "`python manage.py settled_database_url --show-password`",
            code="database_mismatch",
            setting="SETTLED_DATABASE_URL",
        )
    return read.model_copy(update={"database_url": url})


def runtime(using: str = "default") -> Runtime:
    """The runtime of ``using`` (``settled.runtime.build_runtime``), built once from
    ``settings_for(using)``, and kept only once its outbox is built. Its engine, on Django's
    database, connects only if one of its services reads through its own sessions; intake
    writes on Django's connection.

    Raises InvalidSetting as ``settings_for``, ``build_runtime`` and ``Runtime.outbox`` (the
    development keys against PostgreSQL) do; the settings are read again at the next call.
    """
    from settled.runtime import build_runtime  # the services' imports: at first use only

    with _lock:
        built = _runtimes.get(using)
        if built is None:
            built = build_runtime(settings_for(using))
            try:
                built.outbox  # noqa: B018  # refused settings are not kept
            except BaseException:
                built.close()
                raise
            _runtimes[using] = built
        return built


def outbox(using: str = "default") -> Outbox:
    """The outbox intake uses on ``using``: its runtime's (``runtime(using).outbox``; the
    development keys are refused against PostgreSQL) unless ``configure`` gave one."""
    with _lock:
        given = _given.get("outbox")
    if given is not None:
        return given
    return runtime(using).outbox


def publisher() -> Publish:
    """The hint publisher: ``configure``'s, else Settled's Celery app's (its broker from the
    settings), built once, on first use."""
    with _lock:
        if not _publish:
            from settled.celery_app import create_app, hint_publisher

            _publish.append(hint_publisher(create_app(Settings())))
        return _publish[0]


def enqueue(
    *,
    tenant: str,
    op_id: str,
    kind: str,
    params: Mapping[str, Any],
    using: str = "default",
    run: Run | None = None,
    correlation_id: str | None = None,
    compensates: Operation | None = None,
    max_attempts: int | None = None,
    deadline: datetime | None = None,
) -> Enqueued:
    """Record an operation intent in the current ``transaction.atomic(using=using)`` block,
    on Django's connection: ``Outbox.enqueue``'s arguments, answers and typed errors. A new
    operation's hint is published once that transaction commits (``transaction.on_commit``),
    and never if it, or the savepoint around this call, rolls back.

    Raises InvalidInput (``no_transaction``) outside an atomic block, writing nothing.
    ``Enqueued.operation`` is not available here: read ``got.id``, ``got.state``... or
    ``operation_status``.
    """
    door = outbox(using)
    connection = connection_in_atomic(using)
    got = door.enqueue(
        connection,
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
    if got.created and got.id is not None:
        hint_after_commit([got.id], using=using)
    return got


def hint_after_commit(ids: list[int], *, using: str = "default") -> None:
    """Publish hints for ``ids`` once the current transaction on ``using`` commits."""
    publish = publisher()
    transaction.on_commit(lambda: publish_hints(publish, ids), using=using, robust=True)
