"""The FastAPI examples, sync (examples/fastapi_refunds, on SQLite) and async
(examples/fastapi_refunds_async, on PostgreSQL), through TestClient with the same tests: one
business row and one operation per request, committed together; a replay returns the same
operation; bad input is a 4xx that writes nothing; a hint per committed request, which a worker
turns into a refund at the simulator. And each README's commands, run as written."""

from __future__ import annotations

import json
import shlex
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, text
from starlette.exceptions import StarletteDeprecationWarning

from examples.fastapi_refunds.app import create_app as create_sync_app
from examples.fastapi_refunds_async.app import create_app as create_async_app
from outbox.db import make_engine, upgrade
from outbox.errors import InvalidSetting
from outbox.settings import Settings
from settled.runtime import build_runtime
from settled.simulator import SimulatorControl
from tests.conftest import truncate
from tests.support import services
from tests.support.readme_run import exported, follow_readme, readme_commands
from tests.support.simtools import SimTenant
from workers.http_client import HttpGateway

with warnings.catch_warnings():
    # Starlette's TestClient would rather run on httpx2, which is not a dependency; on httpx it
    # works the same, and warns once at import (as in tests/integration/test_web.py).
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

REFUND = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True)
class Flavour:
    """One of the two examples: its folder, its app factory and the database it runs on."""

    name: str
    folder: Path
    create_app: Callable[..., FastAPI]
    database: str  # "sqlite" or "postgresql"


SYNC = Flavour("sync", EXAMPLES / "fastapi_refunds", create_sync_app, "sqlite")
ASYNC = Flavour("async", EXAMPLES / "fastapi_refunds_async", create_async_app, "postgresql")
FLAVOURS = [
    pytest.param(SYNC, id="sync-sqlite"),
    pytest.param(ASYNC, id="async-postgresql", marks=pytest.mark.postgres),
]


@dataclass
class Example:
    client: TestClient
    engine: Engine  # a synchronous engine on the app's database, for the test's own reads
    settings: Settings
    hints: list[list[int]]

    def file(self, key: str, body: dict[str, Any] | None = None) -> Any:
        return self.client.post("/refunds", json=body or REFUND, headers={"Idempotency-Key": key})

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]

    def counts(self) -> tuple[int, int, int]:
        """(business rows, operations, operation events)."""
        ((requests,),) = self.rows("SELECT count(*) FROM refund_requests")
        ((operations,),) = self.rows("SELECT count(*) FROM operations")
        ((events,),) = self.rows("SELECT count(*) FROM operation_events")
        return requests, operations, events


@pytest.fixture(scope="module")
def example_pg_url(pg_server: str) -> Iterator[str]:
    """A migrated database of this module's own for the async example (its app table is not
    the other tests' ``refund_requests``)."""
    with services.throwaway_database(pg_server, f"settled_example_{uuid.uuid4().hex[:8]}") as url:
        upgrade(url)
        yield url


MakeExample = Callable[..., AbstractContextManager[Example]]


@pytest.fixture(params=FLAVOURS)
def make_example(
    request: pytest.FixtureRequest, tmp_path: Path, settings: Settings
) -> Iterator[MakeExample]:
    """Builds the example app of this flavour (``create_app``'s keyword arguments) on an empty
    database, its hints kept in a list, and serves it through TestClient."""
    flavour: Flavour = request.param
    if flavour.database == "postgresql":
        url = request.getfixturevalue("example_pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    own = settings.model_copy(update={"database_url": url})
    reader = make_engine(url)

    @contextmanager
    def make(**kw: Any) -> Iterator[Example]:
        hints: list[list[int]] = []
        app = flavour.create_app(own, publish=lambda ids: hints.append(list(ids)), **kw)
        with TestClient(app) as client:
            yield Example(client, reader, own, hints)
        if flavour is SYNC:
            app.state.engine.dispose()  # the async app disposes of its own at shutdown

    try:
        yield make
    finally:
        if flavour.database == "postgresql":  # the module's database, for the next test
            truncate(reader)
            with reader.begin() as conn:
                conn.execute(text("DROP TABLE IF EXISTS refund_requests"))
        reader.dispose()


@pytest.fixture
def example(make_example: MakeExample) -> Iterator[Example]:
    with make_example() as built:
        yield built


def test_each_request_commits_one_business_row_and_one_operation_together(
    example: Example,
) -> None:
    first = example.file("req-1")
    second = example.file("req-2", {**REFUND, "amount_minor": 2500})
    assert (first.status_code, second.status_code) == (201, 201)
    assert first.json()["created"] is True
    assert first.json()["state"] == "planned"
    assert first.json()["op_id"] != second.json()["op_id"]

    joined = example.rows(
        "SELECT r.request_key, o.op_id, o.tenant, o.kind, o.correlation_id, o.id"
        " FROM refund_requests r JOIN operations o ON o.op_id = r.op_id AND o.tenant = r.tenant"
        " ORDER BY r.id"
    )
    assert [row[:5] for row in joined] == [
        ("req-1", first.json()["op_id"], "acme", "refund", "req-1"),
        ("req-2", second.json()["op_id"], "acme", "refund", "req-2"),
    ]
    assert example.counts()[:2] == (2, 2)
    # One hint per committed transaction, naming its operation, published after the commit.
    assert example.hints == [[joined[0][5]], [joined[1][5]]]


def test_a_replay_returns_the_same_operation_and_writes_nothing(example: Example) -> None:
    first = example.file("req-1")
    before = example.counts()
    again = example.file("req-1")
    assert again.status_code == 200
    assert again.json() == {**first.json(), "created": False}
    assert example.counts() == before == (1, 1, 1)
    assert len(example.hints) == 1  # no second hint, so no second send


def test_the_same_key_with_another_body_is_a_conflict_that_writes_nothing(
    example: Example,
) -> None:
    example.file("req-1")
    before = example.counts()
    other = example.file("req-1", {**REFUND, "amount_minor": 20000})
    assert other.status_code == 409
    assert other.json()["detail"]["code"] == "idempotency_conflict"
    assert example.counts() == before
    assert example.rows("SELECT amount_minor FROM refund_requests") == [(10000,)]
    assert len(example.hints) == 1


@pytest.mark.parametrize(
    ("body", "key", "settled_code"),
    [
        ({**REFUND, "currency": "cny"}, "req-1", "invalid_params"),  # never silently changed
        ({**REFUND, "currency": "XXQ"}, "req-1", "invalid_params"),
        ({**REFUND, "amount_minor": 0}, "req-1", "invalid_params"),
        ({**REFUND, "amount_minor": 10**15}, "req-1", "invalid_params"),  # past the limit
        ({**REFUND, "amount_minor": 10**20}, "req-1", "invalid_params"),  # past any column
        ({**REFUND, "payee": "P 7\x00"}, "req-1", "invalid_params"),
        ({**REFUND, "order_id": "x" * 65}, "req-1", "invalid_params"),
        ({**REFUND, "amount_minor": "10000"}, "req-1", None),  # a string is not an amount
        ({**REFUND, "amount_minor": 100.5}, "req-1", None),
        ({**REFUND, "note": "extra"}, "req-1", None),
        ({k: v for k, v in REFUND.items() if k != "payee"}, "req-1", None),
        (REFUND, "has space", None),
        (REFUND, "k" * 65, None),
        (REFUND, "", None),
    ],
)
def test_bad_input_is_a_4xx_that_writes_nothing(
    example: Example, body: dict[str, Any], key: str, settled_code: str | None
) -> None:
    answer = example.file(key, body)
    assert answer.status_code == 422, answer.text
    if settled_code is not None:  # refused by Settled's intent model, not by the app's
        assert answer.json()["detail"]["code"] == settled_code
    assert example.counts() == (0, 0, 0)
    assert example.hints == []


def test_a_missing_request_key_is_a_4xx_that_writes_nothing(example: Example) -> None:
    answer = example.client.post("/refunds", json=REFUND)
    assert answer.status_code == 422
    assert example.counts() == (0, 0, 0)


def test_a_rejected_request_leaves_its_key_free_for_a_good_one(example: Example) -> None:
    assert example.file("req-1", {**REFUND, "currency": "cny"}).status_code == 422
    assert example.file("req-1").status_code == 201
    assert example.counts()[:2] == (1, 1)


def test_the_status_shows_the_request_and_where_its_operation_stands(
    example: Example,
) -> None:
    filed = example.file("req-1").json()
    status = example.client.get("/refunds/req-1")
    assert status.status_code == 200
    body = status.json()
    assert body["request"] == {
        "request_key": "req-1",
        "order_id": "A1042",
        "amount_minor": 10000,
        "currency": "CNY",
    }
    assert body["operation"]["op_id"] == filed["op_id"]
    assert body["operation"]["state"] == "planned"
    assert "payee" not in status.text  # the payee stays in the database
    assert example.client.get("/refunds/nope").status_code == 404


def test_a_worker_turns_the_hint_into_one_refund_at_the_downstream(
    example: Example,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    sim_gateway: HttpGateway,
) -> None:
    sim_control.create_order(sim_tenant.name, "A1042", 50000)
    filed = example.file("req-1").json()
    example.file("req-1")  # a replay: no second hint, no second send
    (hint,) = example.hints
    runtime = build_runtime(example.settings, gateway=sim_gateway)
    try:
        assert list(runtime.executor.execute(hint).values()) == ["succeeded"]
    finally:
        runtime.close()
    status = example.client.get("/refunds/req-1").json()["operation"]
    assert (status["op_id"], status["state"]) == (filed["op_id"], "succeeded")
    ((key,),) = example.rows("SELECT idempotency_key FROM operations")
    assert sim_control.effects(sim_tenant.name, key) == 1
    assert sim_control.refunded(sim_tenant.name, "A1042") == 10000


def test_the_business_row_is_rolled_back_when_settled_refuses_the_operation(
    make_example: MakeExample,
) -> None:
    """The refusal comes after the business row was written (the tenant is checked by
    ``Outbox.enqueue``): neither row may stay."""
    with make_example(tenant="Not A Tenant") as example:
        answer = example.file("req-1")
        assert answer.status_code == 422
        assert answer.json()["detail"]["code"] == "invalid_tenant"
        assert example.counts() == (0, 0, 0)
        assert example.hints == []


def test_the_async_example_refuses_sqlite_before_writing_anything(tmp_path: Path) -> None:
    """On the embedded default (an SQLite file) the async example is refused up front, with
    the setting named: nothing is migrated, no file is created."""
    path = tmp_path / "app.sqlite3"
    with pytest.raises(InvalidSetting) as refused:
        create_async_app(Settings(database_url=f"sqlite:///{path}"), publish=lambda ids: None)
    assert refused.value.code == "postgresql_only"
    assert refused.value.data == {"setting": "SETTLED_DATABASE_URL"}
    assert not path.exists()


# -- the README's commands, run as written -----------------------------------------------------


@pytest.mark.slow
def test_the_readme_followed_word_for_word_ends_in_a_refund(tmp_path: Path) -> None:
    """The sync example's "Run it", on the embedded defaults (an SQLite file, the filesystem
    broker: nothing of the user's own to replace). A README that starts the worker before any
    ``settled db upgrade`` leaves the refund ``planned``: the worker refuses the unmigrated
    database and nothing sends it."""
    answer = follow_readme(SYNC.folder, tmp_path, app="uvicorn")
    assert '"re_' in json.dumps(answer["operation"])  # the downstream's reference


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_the_async_readme_followed_word_for_word_ends_in_a_refund(
    tmp_path: Path, pg_server: str, redis_url: str
) -> None:
    """The async example's "Run it", its PostgreSQL database a throwaway one (empty, as the
    README asks: ``settled db upgrade`` migrates it) and its Redis a server of the test's own,
    in place of the README's addresses."""
    commands = readme_commands(ASYNC.folder)
    name = f"settled_readme_{uuid.uuid4().hex[:8]}"
    with services.throwaway_database(pg_server, name) as url:
        own = {
            exported(commands, "SETTLED_DATABASE_URL"): shlex.quote(url),
            exported(commands, "SETTLED_BROKER_URL"): shlex.quote(redis_url),
        }
        answer = follow_readme(ASYNC.folder, tmp_path, app="uvicorn", own=own)
        assert '"re_' in json.dumps(answer["operation"])  # the downstream's reference
        engine = make_engine(url)  # the refund the app wrote is in that database
        try:
            with engine.connect() as conn:
                stored = conn.execute(text("SELECT request_key, op_id FROM refund_requests"))
                assert [tuple(row) for row in stored] == [
                    (answer["request"]["request_key"], answer["operation"]["op_id"])
                ]
        finally:
            engine.dispose()
