"""The FastAPI examples, sync (examples/fastapi_refunds, on SQLite) and async
(examples/fastapi_refunds_async, on PostgreSQL), through TestClient with the same tests: one
business row and one operation per request, committed together; a replay returns the same
operation; bad input is a 4xx that writes nothing; a hint per committed request, which a worker
turns into a refund at the simulator. And each README's commands, run as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
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
from tests.support.services import free_port
from tests.support.simtools import SimTenant, wait_until
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

#: commands that keep running: the README starts each in a terminal of its own
SERVERS = ("settled simulator", "settled worker", "uvicorn")


def readme_commands(example: Path) -> list[str]:
    """The shell commands of ``example``'s README's "Run it" section, in order, continuation
    lines joined."""
    section = (example / "README.md").read_text().split("## Run it", 1)[1].split("\n## ", 1)[0]
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                commands.append(line.strip())
    return commands


def exported(commands: list[str], name: str) -> str:
    """The value the README's ``export`` lines give variable ``name`` (unquoted)."""
    values = [
        word.split("=", 1)[1]
        for command in commands
        if command.startswith("export ")
        for word in shlex.split(command, comments=True)[1:]
        if word.startswith(f"{name}=")
    ]
    assert len(values) == 1, f"the README exports {name} {len(values)} times"
    return values[0]


class Terminals:
    """The user's terminals: one shell per server, each after the README's ``export`` lines."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        self.exports: list[str] = []
        self.servers: dict[str, subprocess.Popen[bytes]] = {}

    def script(self, command: str) -> str:
        return "set -e\n" + "\n".join([*self.exports, command])

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-c", self.script(command)], cwd=self.folder, env=self.env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{command!r} failed:\n{done.stdout}{done.stderr}"
        return done

    def start(self, name: str, command: str) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.err").open("wb") as err:
            proc = subprocess.Popen(
                ["bash", "-c", self.script(f"exec {command}")], cwd=self.folder, env=self.env,
                stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        self.servers[name] = proc
        return proc

    def stderr(self, name: str) -> str:
        return (self.folder / f"{name}.err").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def follow_readme(example: Path, tmp_path: Path, own: dict[str, str]) -> dict[str, Any]:
    """Every command of ``example``'s "Run it" as a user runs it, from a checkout's root
    (``examples/`` there), with each text of ``own`` (what is the user's own: a database, a
    broker) replaced by the test's, and free ports instead of 8700 and 8080. Returns the last
    command's answer once it shows the refund ``succeeded``; fails the test if it never does."""
    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    sim_port, app_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SETTLED_", "OTEL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    terminals = Terminals(tmp_path, env)
    ready = {
        "settled simulator": lambda: _answers(f"http://127.0.0.1:{sim_port}/_control/faults"),
        "settled worker": lambda: " ready." in terminals.stderr("settled worker"),
        "uvicorn": lambda: _answers(f"http://127.0.0.1:{app_port}/refunds/none"),
    }
    commands = [c.replace("8700", str(sim_port)).replace("8080", str(app_port))
                for c in readme_commands(example)]  # fmt: skip
    for theirs, ours in own.items():  # after the ports: ours may hold any digits
        assert any(theirs in c for c in commands), f"the README never says {theirs!r}"
        commands = [c.replace(theirs, ours) for c in commands]
    *steps, status = commands
    assert status.startswith("curl ") and "/refunds/" in status
    try:
        for command in steps:
            if command.startswith("export "):
                terminals.exports.append(command)
                continue
            server = next((s for s in SERVERS if command.startswith(s)), None)
            if server is None:
                terminals.run(command)
                continue
            proc = terminals.start(server, command)

            def up(server: str = server, proc: Any = proc) -> bool:
                assert proc.poll() is None, (
                    f"{server} exited ({proc.returncode}):\n{terminals.stderr(server)}"
                )
                return bool(ready[server]())

            wait_until(up, 60, f"{server} to be ready")
        answers: list[dict[str, Any]] = []

        def refunded() -> bool:
            answers.append(json.loads(terminals.run(status).stdout))
            return bool(answers[-1].get("operation", {}).get("state") == "succeeded")

        wait_until(refunded, 60, "the refund to succeed (as the README's last command shows)")
        return answers[-1]
    finally:
        terminals.stop()


@pytest.mark.slow
def test_the_readme_followed_word_for_word_ends_in_a_refund(tmp_path: Path) -> None:
    """The sync example's "Run it", on the embedded defaults (an SQLite file, the filesystem
    broker: nothing of the user's own to replace). A README that starts the worker before any
    ``settled db upgrade`` leaves the refund ``planned``: the worker refuses the unmigrated
    database and nothing sends it."""
    answer = follow_readme(SYNC.folder, tmp_path, own={})
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
        answer = follow_readme(ASYNC.folder, tmp_path, own=own)
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
