"""Real worker processes for integration tests: ``settled worker`` against PostgreSQL, Redis
and a simulator, configured through the environment exactly as in production."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from outbox.settings import Settings


@dataclass
class Stack:
    database_url: str
    broker_url: str
    downstream_url: str
    api_keys: dict[str, str]
    workdir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    files: list[IO[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.database_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.downstream_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps(self.api_keys),
            SETTLED_DOWNSTREAM_TIMEOUT="5.0",  # generous: a loaded CI machine must not time out
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": "test-fingerprint-key-0001"}),
            SETTLED_IDEMPOTENCY_SECRET="test-idempotency-secret",
            SETTLED_LEASE_SECONDS="2",
            SETTLED_SWEEP_SECONDS="0.5",
            SETTLED_RECONCILE_SECONDS="0.5",
            SETTLED_BEAT_SCHEDULE_FILE=str(self.workdir / f"beat-{len(self.procs)}"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env_extra)
        env.update(extra)
        return env

    def settings(self) -> Settings:
        return Settings(
            database_url=self.database_url,
            broker_url=self.broker_url,
            downstream_url=self.downstream_url,
            fingerprint_keys={"v1": "test-fingerprint-key-0001"},
            idempotency_secret="test-idempotency-secret",
        )

    def start_worker(
        self,
        *,
        beat: bool = False,
        pool: str = "solo",
        concurrency: int = 2,
        name: str | None = None,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        argv = [
            sys.executable, "-m", "outbox.cli", "worker", f"--pool={pool}",
            f"--concurrency={concurrency}", "--loglevel=INFO",
            f"--hostname={name or f'w{n}'}@%h",
            "--beat" if beat else "--no-beat",
        ]  # fmt: skip
        log = open(self.workdir / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed in stop_all
        self.files.append(log)
        proc = subprocess.Popen(
            argv, env=self.env(**env), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.workdir.glob("worker-*.log"))
        )

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot terminate
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        for f in self.files:
            f.close()
        self.files.clear()
