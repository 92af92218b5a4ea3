"""Misconfiguration stops at start, in one line, everywhere: the real ``settled`` commands, each
in a process of its own, against PostgreSQL, a Redis of the test's own and the simulator, with a
refund waiting (planned, no hint). Each refusal is one ``Error:`` line on stderr and a non-zero
exit, and leaves the refund planned with no attempt, the simulator's ledger empty, the broker
empty and the working folder empty (no ``./settled.sqlite3``). A start that passes names its
database (password masked), its schema and its broker in one line; ``settled run`` stops, with
the child's status, when a child exits before it was ready.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from outbox.db import alembic_config, upgrade
from outbox.intake import CREATED_KEY, Outbox
from outbox.models import Attempt, Operation, OperationEvent
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.support import services
from tests.support.services import free_port
from tests.support.simtools import SimTenant, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

(HEAD,) = ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()
GOOD = {"order_id": "A1042", "amount_minor": 100, "currency": "CNY", "payee": "P-7"}
#: The test server's replication as a start line says it: a primary with no standbys.
ALONE = "replication (synchronous_commit on, synchronous_standby_names '', no standbys)"
#: A password the trust-authenticated test server ignores, and no line may show.
PASSWORD = "pw-never-shown"


@dataclass
class World:
    database_url: str
    broker_url: str
    downstream_url: str
    api_keys: dict[str, str]
    workdir: Path
    engine: Engine
    control: SimulatorControl
    op_id: int

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.database_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.downstream_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps(self.api_keys),
            SETTLED_DOWNSTREAM_TIMEOUT="1",
            SETTLED_LEASE_SECONDS="5",
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": "test-fingerprint-key-0001"}),
            SETTLED_IDEMPOTENCY_SECRET="test-idempotency-secret",
            SETTLED_AGENT_TENANT="acme",
            SETTLED_STAFF_ID="alice",
            SETTLED_BEAT_SCHEDULE_FILE=str(self.workdir.parent / "beat" / "schedule"),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return {k: v for k, v in env.items() if v != ""}  # "": unset it

    def untouched(self) -> None:
        """Nothing was written, sent or published, and no file was created."""
        with self.engine.connect() as conn:
            state = conn.scalar(select(Operation.state).where(Operation.id == self.op_id))
            attempts = conn.scalar(select(func.count()).select_from(Attempt))
            events = conn.scalar(select(func.count()).select_from(OperationEvent))
        assert (state, attempts, events) == ("planned", 0, 1)  # its intake event only
        assert self.control.refunded("acme", "A1042") == 0
        client = redis.Redis.from_url(self.broker_url)
        try:
            assert client.dbsize() == 0, client.keys()
        finally:
            client.close()
        assert list(self.workdir.iterdir()) == []


@pytest.fixture
def world(
    pg: Engine,
    pg_url: str,
    redis_url: str,
    outbox: Outbox,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> World:
    sim_control.create_order("acme", "A1042", 10**6)
    with sessionmaker(pg, expire_on_commit=False).begin() as s:
        got = outbox.enqueue(s, tenant="acme", op_id="op-pre-1", kind="refund", params=GOOD)
        s.info.pop(CREATED_KEY, None)  # no hint: a worker that started would still not send
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    url = make_url(pg_url).set(password=PASSWORD).render_as_string(hide_password=False)
    return World(
        url,
        redis_url,
        simulator.url,
        {sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir,
        pg,
        sim_control,
        got.operation.id,
    )


def settled(
    world: World, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``settled ARGS`` in the world's empty working folder, stdin closed. A command still
    running after ``timeout`` started instead of refusing: it is stopped and the test fails."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "settled.cli", *args],
        env=world.env(**(env or {})),
        cwd=world.workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`settled {' '.join(args)}` started instead of refusing: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("Error: ")
    assert PASSWORD not in result.stdout + result.stderr
    return lines[0]


#: Every command that fingerprints, approves, sends or serves.
STARTS = {
    "worker": ["worker", "--pool=solo"],
    "beat": ["beat"],
    "web": ["web", "--port={port}"],
    "run": ["run", "--web-port={port}", "--concurrency=1"],
    "mcp-stdio": ["mcp"],
    "mcp-http": ["mcp", "--transport", "http", "--port={port}"],
    "review": ["review", "list", "--role", "viewer"],
    "reconcile": ["reconcile", "--once"],
    "check": ["check"],
}

#: What is wrong (the environment), and what the one line says.
MISTAKES = {
    "misspelt-database-url": (
        {"SETTLED_DATABASE_URL": "", "SETTLED_DATABSE_URL": "{database}"},
        "unknown setting SETTLED_DATABSE_URL; did you mean SETTLED_DATABASE_URL?",
    ),
    "stripe-without-keys": (
        {"SETTLED_DOWNSTREAM_PROVIDERS": '{"refund": "stripe"}'},
        "SETTLED_STRIPE_API_KEYS is empty",
    ),
    "lease-shorter-than-timeout": (
        {"SETTLED_LEASE_SECONDS": "3", "SETTLED_DOWNSTREAM_TIMEOUT": "10"},
        "SETTLED_LEASE_SECONDS (3 s) is shorter than SETTLED_DOWNSTREAM_TIMEOUT (10 s)",
    ),
    "downstream-url-without-scheme": (
        {"SETTLED_DOWNSTREAM_URL": "127.0.0.1:8700"},
        "SETTLED_DOWNSTREAM_URL must be an http:// or https:// URL with a host",
    ),
    "broker-typo": (
        {"SETTLED_BROKER_URL": "redsi://127.0.0.1:6399/0"},
        "SETTLED_BROKER_URL has no known transport 'redsi://'; did you mean redis://?",
    ),
    "development-secrets": (
        {"SETTLED_FINGERPRINT_KEYS": "", "SETTLED_IDEMPOTENCY_SECRET": ""},
        "refusing to start against PostgreSQL with the development value of "
        "SETTLED_FINGERPRINT_KEYS and SETTLED_IDEMPOTENCY_SECRET",
    ),
    "database-down": (
        {"SETTLED_DATABASE_URL": f"postgresql+psycopg://settled:{PASSWORD}@127.0.0.1:1/x"},
        "database error (OperationalError)",
    ),
}


def argv(command: str) -> list[str]:
    port = str(free_port())  # were it to start, on a port of its own
    return [word.replace("{port}", port) for word in STARTS[command]]


#: Which command meets which mistake: every mistake at the worker and at ``check``; at the
#: others, what passed silently there (``tests/unit/test_preflight.py`` runs every pair in
#: process).
CASES = [
    *((command, mistake) for command in ("worker", "check") for mistake in MISTAKES),
    *(
        (command, mistake)
        for command in STARTS
        for mistake in ("misspelt-database-url", "development-secrets")
        if command not in ("worker", "check")
    ),
    ("mcp-http", "database-down"),
    ("mcp-stdio", "database-down"),
    ("beat", "stripe-without-keys"),
    ("beat", "broker-typo"),
    ("run", "lease-shorter-than-timeout"),
    ("run", "broker-typo"),
    ("mcp-http", "broker-typo"),
    ("web", "downstream-url-without-scheme"),
    ("reconcile", "stripe-without-keys"),
    ("review", "stripe-without-keys"),
]


@pytest.mark.parametrize(("command", "mistake"), CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_a_misconfigured_start_is_one_line_and_touches_nothing(
    world: World, command: str, mistake: str
) -> None:
    env, expected = MISTAKES[mistake]
    env = {k: v.replace("{database}", world.database_url) for k, v in env.items()}
    line = one_line_error(settled(world, *argv(command), env=env))
    assert expected in line, line
    world.untouched()


@pytest.fixture
def behind(pg_server: str, world: World) -> Iterator[str]:
    """A database of its own at migration 0003."""
    name = f"settled_behind_{os.getpid()}"
    with services.throwaway_database(pg_server, name) as url:
        upgrade(url, "0003")
        yield url


@pytest.mark.parametrize("command", ["worker", "web", "mcp-http", "review", "check"])
def test_a_start_on_a_database_behind_says_to_upgrade(
    world: World, behind: str, command: str
) -> None:
    line = one_line_error(settled(world, *argv(command), env={"SETTLED_DATABASE_URL": behind}))
    assert line.endswith(
        f"the database is not migrated (at ['0003'], newest ['{HEAD}']): run `settled db upgrade`"
    ), line
    world.untouched()


def test_db_upgrade_and_current_name_the_database_and_the_versions(
    world: World, behind: str
) -> None:
    env = {"SETTLED_DATABASE_URL": make_url(behind).set(password=PASSWORD).render_as_string(False)}
    shown = make_url(env["SETTLED_DATABASE_URL"]).render_as_string(hide_password=True)
    current = settled(world, "db", "current", env=env)
    assert current.stdout == f"{shown} at 0003; newest {HEAD}: run `settled db upgrade`\n"
    upgraded = settled(world, "db", "upgrade", env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout == f"migrated {shown} from 0003 to {HEAD}\n"
    again = settled(world, "db", "upgrade", env=env)
    assert again.stdout == f"{shown} already at {HEAD}\n"
    assert settled(world, "db", "current", env=env).stdout == f"{shown} at {HEAD} (the newest)\n"
    assert PASSWORD not in upgraded.stdout + upgraded.stderr
    assert list(world.workdir.iterdir()) == []


def test_check_passes_and_names_database_schema_and_broker_without_the_password(
    world: World,
) -> None:
    result = settled(world, "check")
    assert result.returncode == 0, result.stderr
    shown = make_url(world.database_url).render_as_string(hide_password=True)
    assert f":{PASSWORD}@" in world.database_url and ":***@" in shown
    assert result.stdout == (
        f"settled check: database {shown} at schema {HEAD}, {ALONE}, broker {world.broker_url}\n"
    )
    world.untouched()


def test_check_with_the_broker_down_fails_and_without_it_passes(world: World) -> None:
    down = {"SETTLED_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    line = one_line_error(settled(world, "check", env=down))
    assert "cannot reach the broker at redis://127.0.0.1" in line
    assert settled(world, "check", "--no-broker", env=down).returncode == 0


def first_line_of_a_worker(world: World, **env: str) -> str:
    """The first line a ``settled worker`` that starts writes (it is then stopped)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "settled.cli", "worker", "--pool=solo"],
        env=world.env(**env),
        cwd=world.workdir.parent,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    return first


def test_a_worker_that_starts_says_on_what_in_one_line(world: World) -> None:
    first = first_line_of_a_worker(world)
    shown = make_url(world.database_url).render_as_string(hide_password=True)
    line = json.loads(first)  # a JSON line like every other
    assert line["msg"] == (
        f"settled worker: database {shown} at schema {HEAD}, {ALONE}, broker {world.broker_url}"
    )
    assert (line["database"], line["schema"], line["broker"]) == (shown, HEAD, world.broker_url)
    assert PASSWORD not in first


# -- a declared deadline fence, probed ------------------------------------------------------

#: The refund's contract declares the deadline fence (the simulator keeps it while its
#: ``deadline_fence`` switch is on).
FENCED = {"SETTLED_DOWNSTREAM_CONTRACTS": json.dumps({"refund": {"enforces_deadline": True}})}
#: The commands that send or settle by themselves: each probes the declared fences at start.
PROBED = ["worker", "beat", "run", "reconcile", "check"]


def test_check_probes_each_declared_fence_and_names_the_kind_and_url(world: World) -> None:
    result = settled(world, "check", env=FENCED)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.endswith(f"broker {world.broker_url}, deadline fence verified for refund")
    assert second == (
        f"settled check: kind refund: deadline fence verified at {world.downstream_url}"
        "/v1/refunds (refused a request past its deadline: 408 deadline_exceeded)"
    )
    world.untouched()
    assert world.control.ledger()["requests"] == []  # refused before it was even counted


@pytest.mark.parametrize("command", PROBED)
def test_a_start_against_a_downstream_without_the_declared_fence_stops_naming_the_kind(
    world: World, command: str
) -> None:
    world.control.set_switches(deadline_fence=False)
    line = one_line_error(settled(world, *argv(command), env=FENCED))
    assert "SETTLED_DOWNSTREAM_CONTRACTS declares enforces_deadline" in line, line
    assert (
        f"kind 'refund' at {world.downstream_url}/v1/refunds: answered HTTP 400 invalid_request"
    ) in line, line
    assert world.api_keys["acme"] not in line
    world.untouched()


def test_a_start_with_the_fenced_downstream_unreachable_stops_naming_kind_and_url(
    world: World,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {**FENCED, "SETTLED_DOWNSTREAM_URL": url}
    line = one_line_error(settled(world, *argv("worker"), env=env))
    assert f"kind 'refund' at {url}/v1/refunds: no answer (ConnectError)" in line, line
    world.untouched()


def test_check_without_the_probe_does_not_ask_the_downstream(world: World) -> None:
    world.control.set_switches(deadline_fence=False)
    result = settled(world, "check", "--no-probe", env=FENCED)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1
    assert world.control.ledger()["requests"] == []


def test_a_worker_whose_declared_fence_is_kept_starts_and_says_so(world: World) -> None:
    line = json.loads(first_line_of_a_worker(world, **FENCED))
    assert line["msg"].startswith("settled worker: database "), line
    assert line["msg"].endswith(", deadline fence verified for refund")
    assert line["fences_verified"] == "refund"


# -- settled run ----------------------------------------------------------------------------


def start_run(world: World, port: int) -> subprocess.Popen[str]:
    """``settled run`` with web on ``port``, in a process group of its own, stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "settled.cli", "run", f"--web-port={port}", "--concurrency=1"],
        env=world.env(SETTLED_LOG_LEVEL="WARNING"),
        cwd=world.workdir.parent,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_run_stops_with_the_status_of_a_child_that_fails_its_start(world: World) -> None:
    """The port of web is taken: web passes its preflight but never listens; ``settled run``
    stops worker and beat and exits with web's status instead of restarting it forever."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_run(world, port)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            pytest.fail(f"settled run kept restarting web: {err[-3000:]}")
    assert proc.returncode not in (0, None), err[-3000:]
    assert f"web --host=127.0.0.1 --port={port} exited with status" in err, err[-3000:]
    assert "before it was ready; stopping" in err
    assert "restarting" not in err


def test_run_with_a_misconfiguration_refuses_before_any_child_starts(world: World) -> None:
    result = settled(world, "run", env={"SETTLED_DOWNSTREAM_PROVIDERS": '{"refund": "stripe"}'})
    assert "SETTLED_STRIPE_API_KEYS is empty" in one_line_error(result)
    world.untouched()


def test_run_restarts_a_child_that_dies_after_it_was_ready(world: World) -> None:
    port = free_port()
    proc = start_run(world, port)
    said: list[str] = []
    try:
        assert proc.stderr is not None
        lines = iter(proc.stderr.readline, "")

        def read_until(text: str) -> bool:
            for line in lines:
                said.append(line)
                if text in line:
                    return True
            return False

        assert read_until("settled web: database"), "".join(said)[-3000:]
        web = _child_pid(proc.pid, "web")
        wait_until(lambda: _listening(port), 60, "web listening")
        os.kill(web, signal.SIGKILL)
        assert read_until("exited with status -9; restarting in 1 s"), "".join(said)[-3000:]
        assert read_until("restarting web"), "".join(said)[-3000:]
        wait_until(lambda: _listening(port) and _child_pid(proc.pid, "web") != web, 60, "a new web")
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)


def _child_pid(parent: int, command: str) -> int:
    """The pid of ``parent``'s child running ``settled COMMAND``."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if command.encode() in argv:
            return int(pid)
    raise AssertionError(f"no {command} child of {parent}")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
