"""``settled run`` against PostgreSQL and Redis: its web child serves ``/healthz``, the status
API (with a key made by ``settled apikey create``) and the console's sign-in page, its beat and
worker children settle an operation, it stays up, and it stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from outbox.intake import CREATED_KEY, Outbox
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.support.services import free_port
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

GOOD = {"order_id": "A1042", "amount_minor": 100, "currency": "CNY", "payee": "P-7"}


@pytest.fixture
def broker_url(redis_url: str) -> Iterator[str]:
    url = redis_url.rsplit("/", 1)[0] + "/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def stack(
    pg: Engine,
    pg_url: str,
    broker_url: str,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> Iterator[Stack]:
    sim_control.create_order("acme", "A1042", 10**9)
    s = Stack(
        database_url=pg_url,
        broker_url=broker_url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    yield s
    s.stop_all()


def status(url: str, **headers: str) -> int:
    try:
        return httpx.get(url, headers=headers, timeout=5).status_code
    except httpx.TransportError:
        return 0


def test_settled_run_serves_healthz_settles_operations_and_stays_up(
    stack: Stack, pg: Engine, outbox: Outbox
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run = stack.start("run", "--web-host=127.0.0.1", f"--web-port={port}", "--concurrency=1")
    try:
        wait_until(lambda: status(f"{base}/healthz") == 200 or run.poll() is not None, 90, "web")
        assert run.poll() is None, stack.log_of(run)[-4000:]  # was: exit 1, "No such command 'web'"
        assert status(f"{base}/healthz") == 200
        login = httpx.get(f"{base}/console/login", timeout=5)  # the console is served too
        assert login.status_code == 200
        assert 'action="/console/login"' in login.text and 'name="csrf_token"' in login.text

        made = subprocess.run(
            [sys.executable, "-m", "settled.cli", "apikey", "create", "--tenant", "acme"],
            env=stack.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert made.returncode == 0, made.stderr
        auth = {"Authorization": f"Bearer {made.stdout.strip()}"}

        # No hint is published: only beat's sweeper can hand the operation to the worker.
        sessions = sessionmaker(pg, expire_on_commit=False)
        with sessions.begin() as s:
            outbox.enqueue(s, tenant="acme", op_id="op-run-1", kind="refund", params=GOOD)
            s.info.pop(CREATED_KEY, None)
        operation = f"{base}/v1/operations/op-run-1"
        assert status(operation) == 401
        wait_until(
            lambda: (
                httpx.get(operation, headers=auth, timeout=5).json().get("state") == "succeeded"
            ),
            90,
            "the operation succeeds through beat and the worker",
        )
        assert status(f"{base}/v1/operations/op-missing", **auth) == 404

        # Still up: the supervisor and all three children.
        assert run.poll() is None, stack.log_of(run)[-4000:]
        assert status(f"{base}/healthz") == 200
    except BaseException:
        print(stack.logs())
        raise
    run.send_signal(signal.SIGTERM)
    assert run.wait(60) == 0, stack.log_of(run)[-4000:]
    assert status(f"{base}/healthz") == 0  # web stopped with it
