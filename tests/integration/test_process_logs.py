"""Every kind of ``settled`` process (simulator, worker, beat, web, a CLI command) writes JSON
lines on stderr, with an operation's identity, state, attempt and durations as keys; the
status API's access log included. Run on the embedded default (SQLite, filesystem broker)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.db import make_engine, upgrade
from outbox.intake import Outbox
from outbox.models import Operation
from outbox.settings import Settings
from settled.simulator import SimulatorControl
from tests.support import wechatpay
from tests.support.rig import GOOD
from tests.support.services import free_port
from tests.support.simtools import wait_until

API_KEY = "sk_test_acme_logs_0001"


class Processes:
    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, **extra: str) -> None:
        with (
            (self.folder / f"{name}.err").open("wb") as err,
            (self.folder / f"{name}.out").open("wb") as out,
        ):
            self.running[name] = subprocess.Popen(
                [sys.executable, "-m", "settled.cli", *args],
                env={**self.env, **extra},
                stdout=out,
                stderr=err,
                cwd=self.folder,
            )

    def run(self, name: str, *args: str, **extra: str) -> subprocess.CompletedProcess[bytes]:
        done = subprocess.run(
            [sys.executable, "-m", "settled.cli", *args],
            env={**self.env, **extra},
            capture_output=True,
            cwd=self.folder,
            timeout=60,
            check=False,
        )
        (self.folder / f"{name}.err").write_bytes(done.stderr)
        return done

    def stop(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stdout(self, name: str) -> str:
        return (self.folder / f"{name}.out").read_text()

    def lines(self, name: str, *, besides: str | None = None) -> list[dict[str, Any]]:
        """Every stderr line of ``name`` (but those starting with ``besides``), each of which
        must be a JSON object."""
        text = (self.folder / f"{name}.err").read_text()
        parsed = []
        for line in text.splitlines():
            if line.strip() and not (besides and line.startswith(besides)):
                try:
                    parsed.append(json.loads(line))
                except json.JSONDecodeError:
                    pytest.fail(f"{name} wrote a line that is not JSON: {line!r}\n{text}")
        return parsed


@pytest.fixture
def processes(tmp_path: Path, settings: Settings) -> Iterator[Processes]:
    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    upgrade(url)
    sim_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SETTLED_", "OTEL_"))}
    env.update(
        SETTLED_DATABASE_URL=url,
        SETTLED_BROKER_URL="filesystem://",
        SETTLED_BROKER_FOLDER=str(tmp_path / "broker"),
        SETTLED_DOWNSTREAM_URL=f"http://127.0.0.1:{sim_port}",
        SETTLED_DOWNSTREAM_API_KEYS=json.dumps({"acme": API_KEY}),
        SETTLED_FINGERPRINT_KEYS=json.dumps(settings.fingerprint_key_bytes(), default=bytes.decode),
        SETTLED_IDEMPOTENCY_SECRET=settings.idempotency_secret.get_secret_value(),
        SETTLED_SWEEP_SECONDS="0.5",
        SETTLED_RECONCILE_SECONDS="1",
        SETTLED_BEAT_SCHEDULE_FILE=str(tmp_path / "beat" / "schedule"),
        PYTHONUNBUFFERED="1",
    )
    procs = Processes(tmp_path, env)
    procs.env["SIM_PORT"] = str(sim_port)
    try:
        yield procs
    finally:
        procs.stop()


@pytest.mark.slow
def test_every_process_writes_json_lines_with_the_operations_keys(
    processes: Processes, outbox: Outbox
) -> None:
    sim_port = int(processes.env["SIM_PORT"])
    metrics_port, web_port, mcp_port = free_port(), free_port(), free_port()
    processes.start(
        "simulator", "simulator", f"--port={sim_port}", "--test-mode", f"--tenant=acme={API_KEY}"
    )
    with SimulatorControl(f"http://127.0.0.1:{sim_port}") as control:
        wait_until(_answers(f"http://127.0.0.1:{sim_port}/_control/faults"), 20, "simulator")
        control.create_order("acme", "A1042", 100000)
        alipay_public = control.alipay_public_key()
    platform_serial = wechatpay.register(f"http://127.0.0.1:{sim_port}").platform_serial
    processes.start("worker", "worker", "--pool=solo", SETTLED_METRICS_PORT=str(metrics_port))
    processes.start("beat", "beat")  # its sweeper hints the operation: no relay here
    processes.start("web", "web", f"--port={web_port}")
    processes.start(
        "mcp", "mcp", "--transport=http", f"--port={mcp_port}", SETTLED_LOG_LEVEL="INFO"
    )

    engine = make_engine(processes.env["SETTLED_DATABASE_URL"])
    try:
        with Session(engine) as s, s.begin():
            outbox.enqueue(s, tenant="acme", op_id="op-logs-1", kind="refund", params=GOOD)

        def state() -> str | None:
            with Session(engine) as s:
                return s.scalar(select(Operation.state).where(Operation.op_id == "op-logs-1"))

        wait_until(lambda: state() == "succeeded", 60, "the worker settles the operation")
    finally:
        engine.dispose()

    created = processes.run("apikey", "apikey", "create", "--tenant=acme")
    assert created.returncode == 0, created.stderr
    key = created.stdout.decode().strip().splitlines()[-1]
    base = f"http://127.0.0.1:{web_port}"
    wait_until(_answers(f"{base}/healthz"), 30, "web")
    answer = httpx.get(
        f"{base}/v1/operations/op-logs-1?lang=en",
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    mcp = f"http://127.0.0.1:{mcp_port}/mcp?order=A1042"
    wait_until(_answers(mcp), 30, "the MCP server")
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "logs-test", "version": "1"},
        },
    }
    mcp_answer = httpx.post(
        mcp,
        json=initialize,
        headers={"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream"},
        timeout=10,
    )
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines()
    listed = processes.run(
        "cli", "review", "list", "--staff=alice", "--role=support", SETTLED_LOG_LEVEL="INFO"
    )
    assert listed.returncode == 0, listed.stderr
    processes.stop()

    worker = processes.lines("worker")
    recorded = [line for line in worker if line["msg"] == "attempt recorded"]
    assert recorded, worker
    assert {k: recorded[0][k] for k in ("tenant", "op_id", "kind", "state", "attempt")} == {
        "tenant": "acme",
        "op_id": "op-logs-1",
        "kind": "refund",
        "state": "succeeded",
        "attempt": 1,
    }
    (answered,) = [line for line in worker if line["msg"] == "submit answered"]
    assert answered["op_id"] == "op-logs-1" and answered["duration_ms"] >= 0
    assert not any("P-7" in json.dumps(line) for line in worker)  # the payee never

    assert any(line["logger"].startswith("celery.beat") for line in processes.lines("beat"))

    web = processes.lines("web")
    (access,) = [
        line for line in web if line["logger"] == "settled.access" and "/v1/" in line["path"]
    ]
    assert access["method"] == "GET"
    assert access["path"] == "/v1/operations/op-logs-1"  # never the query
    assert (access["status"], access["tenant"]) == (200, "acme")
    assert access["duration_ms"] >= 0
    assert any(line["logger"].startswith("uvicorn") for line in web)

    # The MCP server's access log has the status API's shape: no client address, no query.
    mcp_lines = processes.lines("mcp", besides="MCP server on ")
    accessed = [line for line in mcp_lines if line["logger"] == "settled.access"]
    assert {"method": "POST", "path": "/mcp", "status": mcp_answer.status_code} in [
        {k: line[k] for k in ("method", "path", "status")} for line in accessed
    ]
    (keyed,) = [line for line in accessed if line["method"] == "POST"]
    assert keyed["tenant"] == "acme" and keyed["duration_ms"] >= 0
    assert mcp_answer.status_code == 200, mcp_answer.text
    assert not any(line["logger"] == "uvicorn.access" for line in mcp_lines)
    assert "A1042" not in (processes.folder / "mcp.err").read_text()  # the query never
    # Quiet: no Celery banner on stdout (only the note its signal handler writes there when
    # it stops), no kombu warning; every stderr line is JSON.
    assert set(processes.stdout("worker").splitlines()) <= {
        "",
        "worker: Warm shutdown (MainProcess)",
    }
    assert processes.stdout("beat") == ""
    for name in ("worker", "beat", "cli"):
        assert not any(line["logger"].startswith("kombu") for line in processes.lines(name))

    simulator = processes.lines("simulator")
    (listening,) = [line for line in simulator if line["msg"] == "simulator listening"]
    # The provider modes' keys were made at start: the ones it answers with are the ones its
    # first line names.
    assert listening["wechatpay_platform_serial"] == platform_serial
    der = serialization.load_pem_public_key(alipay_public.encode()).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert listening["alipay_public_key_sha256"] == hashlib.sha256(der).hexdigest()

    (audit,) = [line for line in processes.lines("cli") if line["logger"] == "settled.audit"]
    assert (audit["staff"], audit["role"]) == ("alice", "support")

    # The worker's metrics read the events of the operation it settled.
    assert 'settled_transitions_total{from_state="submitted",to_state="succeeded"} 1.0' in metrics
    assert 'settled_attempts_total{outcome="done"} 1.0' in metrics


def _answers(url: str) -> Any:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    return check
