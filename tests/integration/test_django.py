"""The Django door (``settled.contrib.django``) through real Django: its own connections to
PostgreSQL (``default``) and an SQLite file (``sqlite``), ``transaction.atomic()`` and
``transaction.on_commit``, the example project's view through Django's test client, and a real
Celery worker settling what that view enqueued.

Django is configured once per test process (``django.setup`` is global): with the example's
apps (``examples/django_refunds`` on ``sys.path``: ``refunds``, ``refunds_site``), this
session's PostgreSQL database and an SQLite file of its own. Nothing else in the suite uses
Django, and nothing here changes what another test sees: the hints go to a list of each
test's own (``configure``), reset after it.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from outbox.db import make_engine
from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    InvalidParams,
    InvalidSetting,
    NotFound,
    SettledError,
    UnknownKind,
)
from outbox.intake import Outbox
from outbox.prune import prune
from outbox.report_lines import Group
from settled.celery_app import hint_publisher
from settled.contrib import django as settled
from settled.contrib.django.database import same_database
from settled.simulator import SimulatorControl
from tests.integration.test_celery_worker import (
    App,
    app,
    assert_at_most_one_effect,
    broker_url,
    stack,
    wait_settled,
)
from tests.support.stack import Stack

pytestmark = [pytest.mark.postgres]

_FIXTURES = (app, broker_url, stack)  # the real worker's, from tests.integration.test_celery_worker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_refunds"
GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
#: Settled's tables, children first (the SQLite file is emptied after each test).
OWN_TABLES = (
    "review_items", "operation_events", "attempts", "operations", "runs", "operation_tombstones",
)  # fmt: skip


@pytest.fixture(scope="session")
def django_project(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Django, configured once for this process, both databases migrated: Django's tables by
    ``migrate``, Settled's by ``settled_migrate`` (PostgreSQL's by the session's fixture)."""
    import django
    from django.conf import settings as django_settings
    from django.core.management import call_command
    from django.db import connections

    url = make_url(pg_url)
    if not django_settings.configured:
        sys.path.insert(0, str(EXAMPLE))
        sqlite_file = tmp_path_factory.mktemp("django") / "app.sqlite3"
        postgres = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.database,
            "USER": url.username or "",
            "PASSWORD": url.password or "",
            "HOST": url.host or str(url.query.get("host") or ""),
            "PORT": str(url.port or ""),
        }
        django_settings.configure(
            DATABASES={
                "default": postgres,
                "sqlite": {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": sqlite_file,
                    "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
                },
                # never connected: what settled_database_url makes of them
                "with_password": {
                    **postgres,
                    "PASSWORD": "pw-not-for-output",
                    "HOST": "db.example",
                    "PORT": "6543",
                    "OPTIONS": {"sslmode": "require", "server_side_binding": True},
                },
                "socket": {**postgres, "HOST": "/var/run/postgresql", "PORT": ""},
                # Django's manual transaction management: autocommit off, no atomic block
                "manual": {**postgres, "AUTOCOMMIT": False},
                "in_memory": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
                "dummy": {"ENGINE": "django.db.backends.dummy"},
            },
            INSTALLED_APPS=["settled.contrib.django", "refunds"],
            ROOT_URLCONF="refunds_site.urls",
            MIDDLEWARE=[],
            USE_TZ=True,
            SECRET_KEY="django-tests-only",
            ALLOWED_HOSTS=["testserver"],
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        )
        django.setup()
        for alias in ("default", "sqlite"):
            call_command("migrate", database=alias, verbosity=0)
        out = io.StringIO()
        call_command("settled_migrate", database="sqlite", stdout=out)
        assert out.getvalue().startswith(f"migrated sqlite:///{sqlite_file} from nothing to ")
    yield
    connections.close_all()


@dataclass
class Door:
    """The door on one database: the hints its commits published, and what it stored."""

    using: str
    hints: list[list[int]]

    def count(self, table: str) -> int:
        from django.db import connections

        with connections[self.using].cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {table}")
            return int(cursor.fetchone()[0])

    def counts(self) -> tuple[int, int, int]:
        """(business rows, operations, operation events)."""
        return (
            self.count("refunds_refundrequest"),
            self.count("operations"),
            self.count("operation_events"),
        )

    def business_row(self, key: str = "req-1") -> Any:
        from refunds.models import RefundRequest

        return RefundRequest.objects.using(self.using).create(
            tenant="acme", request_key=key, op_id="unused", **GOOD
        )

    def commit(self, *steps: Callable[[], object]) -> None:
        """``steps`` in one atomic block: committed, unless one raises."""
        with atomic(self):
            for step in steps:
                step()

    def enqueue(self, op_id: str = "op-1", **kw: Any) -> Any:
        args: dict[str, Any] = {"tenant": "acme", "kind": "refund", "params": GOOD, **kw}
        return settled.enqueue(op_id=op_id, using=self.using, **args)


def _emptied(using: str) -> None:
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute("DELETE FROM refunds_refundrequest")
        if using == "sqlite":  # PostgreSQL's Settled tables: the ``pg`` fixture truncates them
            for table in OWN_TABLES:
                cursor.execute(f"DELETE FROM {table}")


@pytest.fixture(params=["default", "sqlite"], ids=["postgresql", "sqlite"])
def door(
    request: pytest.FixtureRequest, django_project: None, pg: Engine, outbox: Outbox
) -> Iterator[Door]:
    hints: list[list[int]] = []
    settled.configure(outbox=outbox, publish=lambda ids: hints.append(list(ids)))
    try:
        yield Door(request.param, hints)
    finally:
        settled.configure()
        _emptied(request.param)


def atomic(door: Door) -> Any:
    from django.db import transaction

    return transaction.atomic(using=door.using)


class Abandoned(Exception):
    """The app gave up on its transaction."""


# -- intake ------------------------------------------------------------------------------------


def test_the_row_and_the_intent_commit_together_and_one_hint_follows(door: Door) -> None:
    with atomic(door):
        door.business_row()
        got = door.enqueue()
        assert door.hints == []  # nothing is published inside the transaction
    assert (got.created, got.state, got.tenant, got.op_id) == (True, "planned", "acme", "op-1")
    assert door.counts() == (1, 1, 1)
    assert door.hints == [[got.id]]


def test_a_replay_returns_the_same_operation_and_publishes_nothing(door: Door) -> None:
    with atomic(door):
        first = door.enqueue()
    with atomic(door):
        again = door.enqueue()
    assert (again.created, again.id, again.idempotency_key) == (
        False,
        first.id,
        first.idempotency_key,
    )
    assert door.counts() == (0, 1, 1)
    assert door.hints == [[first.id]]


def test_a_replay_of_a_pruned_operation_is_answered_from_its_tombstone(door: Door) -> None:
    with atomic(door):
        first = door.enqueue()
    from django.db import connections

    old = "2000-01-01 00:00:00"  # long before any prune's cutoff, on both databases
    with connections[door.using].cursor() as cursor:  # as if it had been refused long ago
        cursor.execute("UPDATE operations SET state = 'cancelled', created_at = %s,"
                       " updated_at = %s", [old, old])  # fmt: skip
        cursor.execute("UPDATE operation_events SET at = %s", [old])
    engine = make_engine(settled.settled_database_url(door.using))
    try:
        assert prune(engine, timedelta(days=90)).operations == 1
    finally:
        engine.dispose()
    with atomic(door):
        again = door.enqueue()
    assert (again.created, again.id, again.state) == (False, None, "cancelled")
    assert again.pruned is not None and again.idempotency_key == first.idempotency_key
    with pytest.raises(IdempotencyConflict):
        door.commit(lambda: door.enqueue(params={**GOOD, "amount_minor": 20000}))
    assert door.counts() == (0, 0, 0)
    assert door.hints == [[first.id]]  # the replay's commit hints nothing


def test_a_conflicting_replay_raises_and_its_transaction_writes_nothing(door: Door) -> None:
    with atomic(door):
        first = door.enqueue()
    other = {**GOOD, "amount_minor": 20000}
    with pytest.raises(IdempotencyConflict):
        door.commit(door.business_row, lambda: door.enqueue(params=other))
    assert door.counts() == (0, 1, 1)
    assert door.hints == [[first.id]]
    status = settled.operation_status("acme", "op-1", using=door.using)
    assert status["amount_minor"] == 10000  # the stored intent, untouched


def test_op_ids_are_scoped_by_tenant(door: Door) -> None:
    with atomic(door):
        ours = door.enqueue(tenant="acme")
        theirs = door.enqueue(tenant="globex")
        only_ours = door.enqueue("op-2", tenant="acme")
        run = settled.open_run(tenant="acme", using=door.using)
    assert ours.id != theirs.id and ours.idempotency_key != theirs.idempotency_key
    assert theirs.created and door.count("operations") == 3
    with pytest.raises(NotFound):
        settled.operation_status("globex", only_ours.op_id, using=door.using)
    with pytest.raises(NotFound):
        settled.find_run("globex", run.handle, using=door.using)
    assert settled.find_run("acme", run.handle, using=door.using).id == run.id


@pytest.mark.parametrize(
    ("change", "error", "code"),
    [
        ({"tenant": "Not A Tenant"}, InvalidIdentifier, "invalid_tenant"),
        ({"op_id": "op 1\x00"}, InvalidIdentifier, None),
        ({"kind": "teleport"}, UnknownKind, "unknown_kind"),
        ({"params": {**GOOD, "currency": "cny"}}, InvalidParams, "invalid_params"),
        ({"params": {**GOOD, "amount_minor": "10000"}}, InvalidParams, "invalid_params"),
        ({"max_attempts": 0}, InvalidInput, "invalid_budget"),
        ({"correlation_id": "op-1"}, InvalidIdentifier, "op_id_is_correlation_id"),
    ],
)
def test_bad_input_is_a_typed_error_and_its_transaction_writes_nothing(
    door: Door, change: dict[str, Any], error: type[SettledError], code: str | None
) -> None:
    with pytest.raises(error) as raised:
        door.commit(door.business_row, lambda: door.enqueue(**{"op_id": "op-1", **change}))
    if code is not None:
        assert raised.value.code == code
    assert door.counts() == (0, 0, 0)
    assert door.hints == []


def test_a_rollback_leaves_no_row_and_publishes_no_hint(door: Door) -> None:
    def give_up() -> None:
        raise Abandoned

    with pytest.raises(Abandoned):
        door.commit(door.business_row, door.enqueue, give_up)
    assert door.counts() == (0, 0, 0)
    assert door.hints == []


def test_a_savepoint_rolled_back_takes_its_hint_with_it(door: Door) -> None:
    with atomic(door):
        kept = door.enqueue("op-kept")
        try:
            with atomic(door):  # a savepoint
                door.enqueue("op-dropped")
                raise Abandoned
        except Abandoned:
            pass
    assert door.hints == [[kept.id]]
    assert door.count("operations") == 1


def test_outside_atomic_it_is_refused_and_writes_nothing(door: Door) -> None:
    with pytest.raises(InvalidInput) as raised:
        door.enqueue()
    assert raised.value.code == "no_transaction"
    assert "transaction.atomic" in raised.value.message
    assert door.counts() == (0, 0, 0)
    assert door.hints == []


def test_under_manual_transaction_management_it_is_refused_and_writes_nothing(
    door: Door,
) -> None:
    """``AUTOCOMMIT: False``: a transaction is open but no atomic block, so there is no
    on_commit to hint from (Django refuses one there): refused before anything is sent."""
    from django.db import connections

    manual = Door("manual", door.hints)
    try:
        with pytest.raises(InvalidInput) as raised:
            manual.enqueue()
        assert raised.value.code == "no_transaction"
        connections["manual"].commit()  # whatever had been sent would be committed now
    finally:
        connections["manual"].close()
    assert Door("default", []).count("operations") == 0
    assert door.hints == []


def test_in_a_block_marked_for_rollback_it_is_refused(door: Door) -> None:
    from django.db import transaction
    from django.db.transaction import TransactionManagementError

    with atomic(door):
        transaction.set_rollback(True, using=door.using)
        with pytest.raises(TransactionManagementError):
            door.enqueue()
    assert door.counts() == (0, 0, 0)
    assert door.hints == []


@contextmanager
def statements(using: str) -> Iterator[list[int]]:
    """How many SQL statements the database ran on Django's connection inside the block,
    whoever sent them (Settled's bypass Django's cursor, so Django cannot count them): libpq's
    trace of the protocol on PostgreSQL (a CommandComplete per statement), sqlite3's trace
    callback on SQLite (which reports a statement again as each trigger program it runs
    starts, Settled's created-event trigger among them: consecutive repeats of one text are
    one statement). The count is the list's one item, after the block."""
    from django.db import connections

    raw = connections[using].connection
    counted: list[int] = []
    if isinstance(raw, sqlite3.Connection):
        seen: list[str] = []
        raw.set_trace_callback(seen.append)
        try:
            yield counted
        finally:
            raw.set_trace_callback(None)
        counted.append(sum(1 for i, sql in enumerate(seen) if i == 0 or seen[i - 1] != sql))
        return
    assert isinstance(raw, psycopg.Connection)
    with tempfile.TemporaryFile() as trace:
        raw.pgconn.trace(trace.fileno())
        raw.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield counted
        finally:
            raw.pgconn.untrace()
        trace.seek(0)
        counted.append(
            sum(1 for line in trace if line.startswith(b"B\t") and b"CommandComplete" in line)
        )


def test_intake_sends_at_most_two_statements_per_intent(door: Door) -> None:
    with atomic(door):
        door.enqueue("op-warm")  # the connection's first use by Settled: its dialect's set-up
        with statements(door.using) as counted:
            for i in range(10):
                door.enqueue(f"op-{i}")
    (count,) = counted
    assert 10 <= count <= 2 * 10, count  # each intent seen, none past two
    assert door.count("operations") == 11


# -- runs, status, report ------------------------------------------------------------------------


def test_runs_status_and_the_report_from_django_code(door: Door) -> None:
    with atomic(door):
        run = settled.open_run(tenant="acme", title="refund A1042", using=door.using)
        first = door.enqueue("op-1", run=run)
        door.enqueue("op-2", run=run, params={**GOOD, "amount_minor": 500})
    found = settled.find_run("acme", run.handle, using=door.using)  # outside atomic: reads
    assert found.title == "refund A1042"
    report = settled.run_report("acme", run.handle, using=door.using)
    assert sorted(line.op_id for line in report.group(Group.NOT_DONE)) == ["op-1", "op-2"]
    status = settled.operation_status("acme", "op-1", using=door.using)
    assert (status["state"], status["run"], status["amount_minor"]) == (
        "planned",
        run.handle,
        10000,
    )
    assert settled.find_operation("acme", "op-1", using=door.using).id == first.id

    hinted = len(door.hints)
    with atomic(door):
        back = settled.compensate(
            tenant="acme", original="op-1", op_id="op-1-back", kind="refund", params=GOOD,
            using=door.using,
        )  # fmt: skip
        assert len(door.hints) == hinted  # not before the commit
    assert back.compensates_id == first.id
    assert door.hints[hinted:] == [[back.id]]
    with atomic(door):
        cancelled = settled.cancel_run("acme", run.handle, actor="agent-7", using=door.using)
    assert len(cancelled.cancelled_ids) == 3  # the two planned ones and the compensation
    assert cancelled.run.cancel_requested_at is not None
    report = settled.run_report("acme", run.handle, using=door.using)
    assert report.cancelled and {line.state.value for line in report.lines} == {"cancelled"}


@pytest.mark.parametrize(
    "write",
    [
        lambda using: settled.open_run(tenant="acme", using=using),
        lambda using: settled.cancel_run("acme", "run_" + "x" * 32, actor="a", using=using),
        lambda using: settled.compensate(
            tenant="acme", original="op-1", op_id="op-2", kind="refund", params=GOOD, using=using
        ),
    ],
    ids=["open_run", "cancel_run", "compensate"],
)
def test_the_runs_writes_are_refused_outside_atomic(
    door: Door, write: Callable[[str], object]
) -> None:
    with pytest.raises(InvalidInput) as raised:
        write(door.using)
    assert raised.value.code == "no_transaction"
    assert door.count("runs") == 0


def test_an_unknown_operation_or_run_is_not_found(door: Door) -> None:
    for read in (
        lambda: settled.operation_status("acme", "op-none", using=door.using),
        lambda: settled.find_operation("acme", "not an op id\x00", using=door.using),
        lambda: settled.run_report("acme", "run_" + "x" * 32, using=door.using),
    ):
        with pytest.raises(NotFound):
            read()


# -- the database Settled's processes use ------------------------------------------------------


def test_settled_database_url_names_djangos_database(django_project: None, pg_url: str) -> None:
    from django.conf import settings as django_settings

    assert same_database(settled.settled_database_url(), pg_url)
    sqlite_file = Path(django_settings.DATABASES["sqlite"]["NAME"])
    assert settled.settled_database_url("sqlite") == f"sqlite:///{sqlite_file}"
    url = make_url(settled.settled_database_url("with_password"))
    assert (url.drivername, url.host, url.port, url.password) == (
        "postgresql+psycopg",
        "db.example",
        6543,
        "pw-not-for-output",
    )
    assert dict(url.query) == {"sslmode": "require"}  # Django's own options are not libpq's
    socket = make_url(settled.settled_database_url("socket"))
    assert (socket.host, socket.query["host"]) == (None, "/var/run/postgresql")


def test_the_url_command_masks_the_password_unless_asked(django_project: None) -> None:
    from django.core.management import call_command

    masked, shown = io.StringIO(), io.StringIO()
    call_command("settled_database_url", database="with_password", stdout=masked)
    call_command("settled_database_url", "--show-password", database="with_password", stdout=shown)
    assert "pw-not-for-output" not in masked.getvalue() and ":***@" in masked.getvalue()
    assert make_url(shown.getvalue().strip()).password == "pw-not-for-output"


@pytest.mark.parametrize(
    ("using", "code"),
    [("in_memory", "unsupported_database"), ("dummy", "unsupported_database")],
)
def test_a_database_settled_cannot_share_is_refused(
    django_project: None, using: str, code: str
) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(InvalidSetting) as raised:
        settled.settled_database_url(using)
    assert raised.value.code == code
    with pytest.raises(CommandError, match="Settled"):
        call_command("settled_migrate", database=using, stdout=io.StringIO())


def test_psycopg2_is_refused_clearly(django_project: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db.backends.postgresql import psycopg_any

    monkeypatch.setattr(psycopg_any, "is_psycopg3", False)
    with pytest.raises(InvalidSetting) as raised:
        settled.settled_database_url()
    assert raised.value.code == "psycopg2_unsupported"
    assert "psycopg 3" in raised.value.message


def test_the_outbox_is_built_from_the_settings_against_djangos_database(
    django_project: None, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from SETTLED_*, once, by the composition root (the kinds with the settings'
    contracts, as the worker's): the development keys are refused because Django's database
    is PostgreSQL; a SETTLED_DATABASE_URL naming another database is refused."""
    for name in [n for n in os.environ if n.startswith("SETTLED_")]:
        monkeypatch.delenv(name)
    settled.configure()
    try:
        with pytest.raises(InvalidSetting) as raised:
            settled.outbox()
        assert raised.value.code == "development_secrets"
        monkeypatch.setenv(
            "SETTLED_FINGERPRINT_KEYS", json.dumps({"v1": "test-fingerprint-key-0001"})
        )
        monkeypatch.setenv("SETTLED_IDEMPOTENCY_SECRET", "test-idempotency-secret")
        monkeypatch.setenv("SETTLED_DATABASE_URL", "sqlite:///elsewhere.sqlite3")
        with pytest.raises(InvalidSetting) as raised:
            settled.outbox()
        assert raised.value.code == "database_mismatch"
        monkeypatch.setenv("SETTLED_DATABASE_URL", pg_url)
        monkeypatch.setenv(
            "SETTLED_DOWNSTREAM_CONTRACTS", json.dumps({"refund": {"key_retention_seconds": 7200}})
        )
        built = settled.outbox()
        assert settled.outbox() is built  # once
        assert same_database(settled.settings_for().database_url, pg_url)
        # the composition root's, as the worker's: the kinds with the settings' contracts
        assert built is settled.runtime().outbox
        assert built.registry.get("refund").contract.key_retention == timedelta(hours=2)
    finally:
        settled.configure()


# -- the example project's view ------------------------------------------------------------------


@dataclass
class View:
    client: Any
    door: Door

    def file(self, key: str = "req-1", body: Any = None) -> Any:
        return self.client.post(
            "/refunds",
            data=json.dumps(GOOD if body is None else body),
            content_type="application/json",
            headers={"Idempotency-Key": key},
        )


@pytest.fixture
def view(django_project: None, pg: Engine, outbox: Outbox) -> Iterator[View]:
    from django.test import Client

    hints: list[list[int]] = []
    settled.configure(outbox=outbox, publish=lambda ids: hints.append(list(ids)))
    try:
        yield View(Client(), Door("default", hints))
    finally:
        settled.configure()
        _emptied("default")


def test_the_view_files_one_row_and_one_operation_and_answers_a_replay_alike(
    view: View,
) -> None:
    first = view.file()
    again = view.file()
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == {**first.json(), "created": False}
    assert view.door.counts() == (1, 1, 1)
    assert len(view.door.hints) == 1
    status = view.client.get("/refunds/req-1").json()
    assert status["operation"]["op_id"] == first.json()["op_id"]
    assert status["operation"]["state"] == "planned"
    assert "P-7" not in json.dumps(status)  # the payee stays in the database
    assert view.client.get("/refunds/none").status_code == 404


def test_the_view_answers_a_conflict_409_and_writes_nothing(view: View) -> None:
    view.file()
    other = view.file(body={**GOOD, "amount_minor": 20000})
    assert other.status_code == 409
    assert other.json()["code"] == "idempotency_conflict"
    assert view.door.counts() == (1, 1, 1)
    assert len(view.door.hints) == 1


@pytest.mark.parametrize(
    ("body", "key", "code"),
    [
        ({**GOOD, "currency": "cny"}, "req-1", "invalid_params"),
        ({**GOOD, "amount_minor": 0}, "req-1", "invalid_params"),
        ({**GOOD, "amount_minor": 10**20}, "req-1", "invalid_params"),  # past any column
        ({**GOOD, "amount_minor": "10000"}, "req-1", "invalid_body"),
        ({k: v for k, v in GOOD.items() if k != "payee"}, "req-1", "invalid_body"),
        (GOOD, "has space", "invalid_request_key"),
    ],
)
def test_the_view_answers_bad_input_422_and_writes_nothing(
    view: View, body: dict[str, Any], key: str, code: str
) -> None:
    answer = view.file(key, body)
    assert answer.status_code == 422, answer.content
    assert answer.json()["code"] == code
    assert view.door.counts() == (0, 0, 0)
    assert view.door.hints == []


@pytest.mark.slow
@pytest.mark.redis
def test_a_real_worker_settles_what_the_view_enqueued(
    django_project: None,
    app: App,
    stack: Stack,
    outbox: Outbox,
    sim_control: SimulatorControl,
) -> None:
    """No beat, so no sweeper: only the hint the view's on_commit published brings the
    operation to the worker."""
    from django.test import Client

    settled.configure(outbox=outbox, publish=hint_publisher(app.celery))
    try:
        stack.start_worker(pool="solo", beat=False)
        client = Client()
        filed = client.post(
            "/refunds",
            data=json.dumps(GOOD),
            content_type="application/json",
            headers={"Idempotency-Key": "req-worker"},
        )
        assert filed.status_code == 201, filed.content
        status = client.get("/refunds/req-worker").json()["operation"]
        op_id = status["op_id"]
        operation = settled.find_operation("acme", op_id)
        assert wait_settled(app, stack, [operation.id]) == {operation.id: "succeeded"}
        assert assert_at_most_one_effect(app, sim_control, [operation.id]) == [1]
        final = client.get("/refunds/req-worker").json()["operation"]
        assert final["state"] == "succeeded"
        assert '"re_' in json.dumps(final)  # the downstream's reference
    finally:
        settled.configure()
        _emptied("default")
