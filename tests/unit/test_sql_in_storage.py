"""SQL only in storage, read from the source (an AST check, no import; ARCHITECTURE.md, "SQL
lives in storage").

Outside the SQL homes, a module of ``outbox``, ``workers``, ``reconciler``, ``support`` or
``settled``

1. imports from SQLAlchemy only handles, events and errors (``HANDLES``; anything under
   ``sqlalchemy.exc``): never a name that builds SQL (``select``, ``text``, ``func``,
   ``bindparam``, ``table``, ``literal_column``...), whether by ``from sqlalchemy import x``
   or as ``sqlalchemy.x`` / ``sa.x``; and no database driver (``DRIVERS``);
2. calls no method that runs a statement (``RUNS_SQL``: ``execute``, ``exec_driver_sql``,
   ``scalar``, ``scalars``, ``query``...), whatever it is called on; the few calls of that
   name that are not SQL (a Settled service's own ``execute``) are listed in ``NOT_SQL``.

The SQL homes: ``outbox.storage`` (every statement, as its docstring says), ``outbox.models``
(the tables), ``outbox.migrations`` (Alembic); and ``outbox.db``, which holds the engines and
``db_now`` (a SQL construct storage builds its statements with) and runs statements only in
``make_engine`` (SQLite's PRAGMAs and BEGIN on every connection). ``settled.simulator`` is a
product of its own with its own ledger database; its SQL is its own.

An ORM unit of work writes at its flush: ``flush`` is refused like ``execute`` (``session.add``
alone looks like any ``.add``, and writes nothing until a flush or a commit in storage).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.unit import test_layers as layers

#: Modules that hold SQL, with every submodule.
SQL_HOMES = ("outbox.storage", "outbox.models", "outbox.migrations")
#: Modules that may build SQL constructs but run statements only inside the named function.
CONNECTION_SETUP: dict[str, str] = {"outbox.db": "make_engine"}
#: Not checked at all: a product of its own, with its own database.
OWN_DATABASE = ("settled.simulator",)

#: What a module outside the SQL homes may take from SQLAlchemy (and anything under ``EXC``).
HANDLES = frozenset(
    {
        "sqlalchemy.Engine",
        "sqlalchemy.Connection",
        "sqlalchemy.engine.Engine",
        "sqlalchemy.engine.Connection",
        "sqlalchemy.event",
        "sqlalchemy.orm.Session",
        "sqlalchemy.orm.sessionmaker",
        "sqlalchemy.orm.util.has_identity",
        # an app's async sessions, on which intake runs the synchronous core (outbox.aio)
        "sqlalchemy.ext.asyncio.AsyncSession",
        "sqlalchemy.ext.asyncio.AsyncConnection",
        "sqlalchemy.ext.asyncio.async_sessionmaker",
        # database URLs, read and written (Django's DATABASES as Settled's URL:
        # settled.contrib.django.database): values, no SQL
        "sqlalchemy.engine.URL",
        "sqlalchemy.engine.make_url",
    }
)
EXC = "sqlalchemy.exc"
DRIVERS = ("psycopg", "psycopg2", "sqlite3", "asyncpg")
#: Methods that run a statement, on a session, a connection or a DBAPI cursor.
RUNS_SQL = frozenset(
    {
        "execute",
        "executemany",
        "exec_driver_sql",
        "scalar",
        "scalars",
        "query",
        "executescript",
        "flush",
    }
)
#: ``(module, receiver.method)``: calls of a ``RUNS_SQL`` name that run no SQL of their own.
NOT_SQL = frozenset(
    {
        # the worker's service call (workers.executor.Executor.execute): ids in, storage inside
        ("settled.celery_app", "runtime(settings).executor.execute"),
        # the same through workers.coalesce.Coalescer.execute (batches of concurrent hints)
        ("settled.celery_app", "runtime(settings).coalescer().execute"),
    }
)
#: Modules that still break the rule, each with a TODO naming what is left to move there (an
#: entry must go once its module keeps the rule: ``test_the_exceptions_still_name_something_real``).
#: None today.
NOT_YET_MOVED: dict[str, str] = {}


@dataclass(frozen=True, order=True)
class Finding:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def _in(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _allowed(dotted: str) -> bool:
    """Whether ``dotted`` (a full ``sqlalchemy...`` name) is a handle, an event or an error."""
    if dotted == EXC or dotted.startswith(EXC + "."):
        return True
    parts = dotted.split(".")
    return any(".".join(parts[:end]) in HANDLES for end in range(2, len(parts) + 1))


def _dotted(node: ast.expr) -> tuple[str, list[str]] | None:
    """``(root name, [attributes])`` of a chain like ``sa.orm.Session``; None otherwise."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def sql_outside_storage(module: str, source: str) -> list[Finding]:
    """Every place in ``source`` (module ``module``) that builds or runs SQL, by the rule of
    the module docstring (a SQL home is not exempted here: the caller skips it)."""
    tree = ast.parse(source)
    found: list[Finding] = []
    aliases: dict[str, str] = {}  # a local name bound to a sqlalchemy module
    setup = CONNECTION_SETUP.get(module)
    exempt_calls: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == setup:
            exempt_calls.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Call))
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in DRIVERS:
                    found.append(Finding(module, node.lineno, f"imports {alias.name}"))
                elif top == "sqlalchemy":
                    bound = alias.asname or top
                    aliases[bound] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top in DRIVERS:
                found.append(Finding(module, node.lineno, f"imports {node.module}"))
            elif top == "sqlalchemy" and setup is None:
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    if not _allowed(dotted):
                        found.append(Finding(module, node.lineno, f"imports {dotted}"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner and setup is None:
            chain = _dotted(node)
            if chain is not None and chain[0] in aliases:
                dotted = ".".join([aliases[chain[0]], *chain[1]])
                if not _allowed(dotted):
                    found.append(Finding(module, node.lineno, f"uses {dotted}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in RUNS_SQL
            and id(node) not in exempt_calls
        ):
            call = ast.unparse(node.func)
            if (module, call) not in NOT_SQL:
                found.append(Finding(module, node.lineno, f"calls {call}()"))
    return sorted(found)


def findings(root: Path = layers.ROOT, packages: tuple[str, ...] = layers.PACKAGES) -> list[str]:
    """Every breach of the rule under ``root``, but in the modules ``NOT_YET_MOVED``."""
    modules: Mapping[str, Path] = layers.find_modules(root, packages)
    return [
        str(finding)
        for name, path in sorted(modules.items())
        if not _in(name, SQL_HOMES + OWN_DATABASE) and name not in NOT_YET_MOVED
        for finding in sql_outside_storage(name, path.read_text(encoding="utf-8"))
    ]


def test_sql_is_built_and_run_only_in_storage() -> None:
    found = findings()
    assert not found, "SQL outside outbox.storage (ARCHITECTURE.md):\n" + "\n".join(found)


def test_the_exceptions_still_name_something_real() -> None:
    modules = layers.find_modules(layers.ROOT, layers.PACKAGES)
    for module, call in NOT_SQL:
        assert call in modules[module].read_text(encoding="utf-8"), (module, call)
    for module, function in CONNECTION_SETUP.items():
        assert f"def {function}(" in modules[module].read_text(encoding="utf-8")
    for module in NOT_YET_MOVED:
        # an entry is removed once its module keeps the rule
        assert sql_outside_storage(module, modules[module].read_text(encoding="utf-8"))


# The checker itself, on sources made for it: it must see what the real tree must not have.


def _check(source: str, module: str = "outbox.service") -> list[str]:
    return [f"{f.line}: {f.what}" for f in sql_outside_storage(module, source)]


def test_the_check_sees_every_way_to_build_sql() -> None:
    source = (
        "from sqlalchemy import select, Engine\n"  # 1
        "from sqlalchemy.sql.expression import text\n"  # 2
        "import sqlalchemy as sa\n"  # 3
        "import sqlalchemy.orm\n"  # 4
        "def f():\n"  # 5
        "    from sqlalchemy import func\n"  # 6
        "    return sa.literal_column('1'), sqlalchemy.orm.aliased\n"  # 7
        "import sqlite3\n"  # 8
        "from psycopg import sql\n"  # 9
    )
    assert _check(source) == [
        "1: imports sqlalchemy.select",
        "2: imports sqlalchemy.sql.expression.text",
        "6: imports sqlalchemy.func",
        "7: uses sqlalchemy.literal_column",
        "7: uses sqlalchemy.orm.aliased",
        "8: imports sqlite3",
        "9: imports psycopg",
    ]


def test_the_check_lets_handles_events_and_errors_through() -> None:
    source = (
        "import sqlalchemy.exc\n"
        "import sqlalchemy as sa\n"
        "from sqlalchemy import Connection, Engine, event\n"
        "from sqlalchemy.exc import DBAPIError, OperationalError\n"
        "from sqlalchemy.orm import Session, sessionmaker\n"
        "from sqlalchemy.orm.util import has_identity\n"
        "def f(exc):\n"
        "    return isinstance(exc, sqlalchemy.exc.DBAPIError), sa.orm.Session\n"
    )
    assert _check(source) == []


def test_the_check_sees_every_statement_run_whatever_it_is_called_on() -> None:
    source = (
        "def f(session, conn, cur, runtime, settings):\n"  # 1
        "    session.execute(STATEMENT)\n"  # 2
        "    conn.exec_driver_sql('SELECT 1')\n"  # 3
        "    cur.execute('PRAGMA foreign_keys=ON')\n"  # 4
        "    session.scalars(STATEMENT).all()\n"  # 5
        "    session.query(Operation)\n"  # 6
        "    runtime(settings).executor.execute([1])\n"  # 7
        "    self.sessions.begin().connection().scalar(STATEMENT)\n"  # 8
    )
    assert _check(source) == [
        "2: calls session.execute()",
        "3: calls conn.exec_driver_sql()",
        "4: calls cur.execute()",
        "5: calls session.scalars()",
        "6: calls session.query()",
        "7: calls runtime(settings).executor.execute()",
        "8: calls self.sessions.begin().connection().scalar()",
    ]
    # a listed exception is one call in one module, not the name everywhere
    assert _check(source, "settled.celery_app")[-2:] == [
        "6: calls session.query()",
        "8: calls self.sessions.begin().connection().scalar()",
    ]


def test_connection_setup_may_run_statements_only_in_its_function() -> None:
    source = (
        "from sqlalchemy import bindparam, create_engine\n"
        "def make_engine(url):\n"
        "    conn.exec_driver_sql('BEGIN')\n"
        "def check(conn):\n"
        "    conn.scalars(STATEMENT)\n"
    )
    assert _check(source, "outbox.db") == ["5: calls conn.scalars()"]
    assert _check(source, "outbox.other") == [
        "1: imports sqlalchemy.bindparam",
        "1: imports sqlalchemy.create_engine",
        "3: calls conn.exec_driver_sql()",
        "5: calls conn.scalars()",
    ]


def test_the_homes_and_the_simulator_are_not_checked(tmp_path: Path) -> None:
    sql = "from sqlalchemy import select\n"
    layers._tree(
        tmp_path,
        {
            "outbox/__init__.py": "",
            "outbox/models.py": sql,
            "outbox/migrations/versions/0001_initial.py": sql,
            "outbox/storage/__init__.py": sql,
            "outbox/storage/claims.py": sql,
            "outbox/storaged.py": sql,  # a name that starts like a home is not one
            "outbox/intake.py": "def f(session):\n    session.execute(X)\n",
            "settled/__init__.py": "",
            "settled/simulator/ledger.py": sql,
        },
    )
    assert findings(tmp_path, ("outbox", "settled")) == [
        "outbox.intake:2: calls session.execute()",
        "outbox.storaged:1: imports sqlalchemy.select",
    ]
