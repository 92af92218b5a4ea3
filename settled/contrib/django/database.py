"""Django's database, as Settled sees it: the URL of ``DATABASES[using]`` for Settled's own
processes (``settled_database_url``), and the DB-API connection intake writes on
(``connection_in_atomic``), checked first.

Supported: ``django.db.backends.postgresql`` with psycopg 3 (and backends built on it, such as
PostGIS), and ``django.db.backends.sqlite3`` on a file. psycopg2 is refused: Settled's intake
writes through psycopg 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import connections
from sqlalchemy.engine import URL, make_url

from outbox.errors import InvalidInput, InvalidSetting

#: libpq connection parameters a Django ``OPTIONS`` may carry that Settled's URL keeps (the
#: others, ``isolation_level``, ``pool``, ``server_side_binding``..., are Django's own).
LIBPQ_OPTIONS = frozenset(
    {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "sslcrl",
        "options",
        "passfile",
        "service",
        "application_name",
        "connect_timeout",
        "target_session_attrs",
        "channel_binding",
        "gssencmode",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
    }
)


def _psycopg2_refused(using: str) -> InvalidSetting:
    return InvalidSetting(
        f"DATABASES[{using!r}] runs on psycopg2: Settled writes through psycopg 3 "
        "(pip install 'psycopg[binary]'; Django uses it when both are installed)",
        code="psycopg2_unsupported",
        setting="DATABASES",
    )


def _vendor(using: str) -> str:
    """``postgresql`` (on psycopg 3) or ``sqlite``; InvalidSetting for anything else."""
    wrapper = connections[using]
    if wrapper.vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise _psycopg2_refused(using)
        return "postgresql"
    if wrapper.vendor == "sqlite":
        return "sqlite"
    raise InvalidSetting(
        f"DATABASES[{using!r}] is {wrapper.vendor}: Settled supports PostgreSQL "
        "(django.db.backends.postgresql) and SQLite (django.db.backends.sqlite3)",
        code="unsupported_database",
        setting="DATABASES",
    )


def settled_database_url(using: str = "default") -> str:
    """The SQLAlchemy URL of Django's ``DATABASES[using]``, for ``SETTLED_DATABASE_URL``: the
    database Settled's worker, beat and ``settled db upgrade`` must use, so that they see the
    intents the app writes. It carries the password, if Django's settings have one.

    Raises InvalidSetting for another database engine, for psycopg2, and for an SQLite
    database in memory (no other process can open it).
    """
    vendor = _vendor(using)
    params: dict[str, Any] = connections[using].settings_dict
    if vendor == "sqlite":
        name = str(params.get("NAME") or "")
        if name in ("", ":memory:") or "mode=memory" in name:
            raise InvalidSetting(
                f"DATABASES[{using!r}] is an SQLite database in memory: Settled's worker runs "
                "in a process of its own and needs a file",
                code="unsupported_database",
                setting="DATABASES",
            )
        return URL.create("sqlite", database=str(Path(name).resolve())).render_as_string()
    options = params.get("OPTIONS") or {}
    query = {key: str(value) for key, value in options.items() if key in LIBPQ_OPTIONS}
    host = str(params.get("HOST") or "") or None
    if host is not None and host.startswith("/"):  # a socket folder: libpq's host parameter
        query["host"], host = host, None
    port = str(params.get("PORT") or "")
    url = URL.create(
        "postgresql+psycopg",
        username=str(params.get("USER") or "") or None,
        password=str(params.get("PASSWORD") or "") or None,
        host=host,
        port=int(port) if port else None,
        database=str(params.get("NAME") or "") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def same_database(one: str, other: str) -> bool:
    """Whether two database URLs name one database (driver and password aside)."""
    a, b = make_url(one), make_url(other)
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        return Path(a.database or "").resolve() == Path(b.database or "").resolve()

    def where(url: URL) -> tuple[object, ...]:
        return (url.host or url.query.get("host"), url.port or 5432, url.database, url.username)

    return where(a) == where(b)


def connection_in_atomic(using: str) -> Any:
    """The DB-API connection of Django's ``connections[using]`` (connected if it was not),
    inside the ``transaction.atomic()`` block the caller is in.

    Raises InvalidInput (``no_transaction``) outside an atomic block, writing nothing (Django
    would commit each statement by itself, and a hint could not wait for the commit); Django's
    TransactionManagementError when the block already failed and must roll back;
    InvalidSetting for a database Settled does not support.
    """
    wrapper = connections[using]
    vendor = _vendor(using)
    if not wrapper.in_atomic_block:
        raise InvalidInput(
            "Settled writes in the app's transaction: call this inside "
            f"`with transaction.atomic(using={using!r}):`",
            code="no_transaction",
            field="using",
        )
    wrapper.validate_no_broken_transaction()
    wrapper.ensure_connection()
    raw = wrapper.connection
    if vendor == "postgresql" and type(raw).__module__.partition(".")[0] == "psycopg2":
        raise _psycopg2_refused(using)  # (any other driver: outbox.borrowed refuses it)
    return raw
