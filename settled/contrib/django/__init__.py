"""Settled for Django: intake on Django's own connection, in the view's ``transaction.atomic()``
block, with the hint sent by ``transaction.on_commit``.

``INSTALLED_APPS += ["settled.contrib.django"]`` (``pip install 'settled[django]'``), then::

    from django.db import transaction
    from outbox import new_op_id
    from settled.contrib import django as settled

    with transaction.atomic():
        request = RefundRequest.objects.create(order_id="A1042", op_id=new_op_id(), ...)
        got = settled.enqueue(tenant="acme", op_id=request.op_id, kind="refund", params={...})
    # committed: the row and the intent together; the hint is on its way

What it gives::

    enqueue                          Outbox.enqueue on connections[using], inside atomic();
                                     refused outside one (InvalidInput no_transaction)
    open_run, cancel_run, compensate the runs API's writes, in the caller's atomic block
    find_run, run_report,            its reads, anywhere
    operation_status, find_operation
    session                          a SQLAlchemy Session on Django's connection
    settled_database_url             DATABASES[using] as SETTLED_DATABASE_URL for the worker
    configure                        the outbox and the hint publisher, when not the defaults
    outbox, settings_for, runtime    what is built from the SETTLED_* settings

and the commands ``python manage.py settled_migrate`` (Settled's tables on Django's database)
and ``python manage.py settled_database_url``. Supported databases: PostgreSQL on psycopg 3,
and SQLite files (``settled.contrib.django.database``).
"""

from __future__ import annotations

from settled.contrib.django.database import settled_database_url
from settled.contrib.django.intake import configure, enqueue, outbox, runtime, settings_for
from settled.contrib.django.runs import (
    cancel_run,
    compensate,
    find_operation,
    find_run,
    open_run,
    operation_status,
    run_report,
    session,
)

__all__ = [
    "cancel_run",
    "compensate",
    "configure",
    "enqueue",
    "find_operation",
    "find_run",
    "open_run",
    "operation_status",
    "outbox",
    "run_report",
    "runtime",
    "session",
    "settings_for",
    "settled_database_url",
]
