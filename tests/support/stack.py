"""Real ``settled`` processes for integration tests (``settled worker``, ``settled run``)
against PostgreSQL, Redis and a simulator, configured through the environment exactly as in
production (``provider_env``: the settings that send refunds to one of the simulator's
provider modes); and a Redis server of a test's own, to kill and restart under them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from outbox.db import upgrade
from outbox.kinds import default_registry
from outbox.settings import Settings
from settled.simulator import SimulatorControl
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from settled.simulator.wechatpay import PREFIX as WECHATPAY_PREFIX
from tests.support import alipay, wechatpay
from tests.support.services import free_port, redis_binary, spawn_redis, wait_for_own_redis
from tests.support.simtools import SimTenant

Proc = subprocess.Popen[bytes]


#: the app's hint bound in tests (``Stack.settings``)
TEST_HINT_TIMEOUT = 1.0


@dataclass
class Stack:
    database_url: str
    broker_url: str
    downstream_url: str
    api_keys: dict[str, str]
    workdir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    files: list[IO[bytes]] = field(default_factory=list)
    log_paths: dict[int, Path] = field(default_factory=dict)  # by pid

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.database_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.downstream_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps(self.api_keys),
            # What a send gets within the 2 s lease less the 1 s clock margin (the preflight
            # refuses a timeout that does not fit in the lease).
            SETTLED_DOWNSTREAM_TIMEOUT="1.0",
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": "test-fingerprint-key-0001"}),
            SETTLED_IDEMPOTENCY_SECRET="test-idempotency-secret",
            SETTLED_LEASE_SECONDS="2",
            SETTLED_SWEEP_SECONDS="0.5",
            SETTLED_RECONCILE_SECONDS="0.5",
            SETTLED_BEAT_SCHEDULE_FILE=str(self.workdir / f"beat-{len(self.procs)}"),
            # The downstream is the simulator, which refuses requests past their deadline.
            SETTLED_DOWNSTREAM_CONTRACTS=json.dumps(
                {name: {"enforces_deadline": True} for name in default_registry().names()}
            ),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env_extra)
        env.update(extra)
        return env

    def settings(self) -> Settings:
        """The app's settings. Its hints get a second per round trip, not production's 50 ms:
        on a loaded test machine a loopback round trip can stall past 50 ms, and a worker
        started without beat has only the hints to go by (a hint the breaker skipped would
        wait forever there). The production bound is ``test_hint_outage``'s, which passes it."""
        return Settings(
            database_url=self.database_url,
            broker_url=self.broker_url,
            downstream_url=self.downstream_url,
            fingerprint_keys={"v1": "test-fingerprint-key-0001"},
            idempotency_secret="test-idempotency-secret",
            hint_timeout=TEST_HINT_TIMEOUT,
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
        return self.start(
            "worker", f"--pool={pool}", f"--concurrency={concurrency}", "--loglevel=INFO",
            f"--hostname={name or f'w{n}'}@%h", "--beat" if beat else "--no-beat",
            **env,
        )  # fmt: skip

    def start(
        self, *args: str, launcher: Sequence[str] = ("-m", "settled.cli"), **env: str
    ) -> Proc:
        """``settled ARGS`` in its own process (log: ``<command>-<n>.log`` in the workdir).
        ``launcher`` replaces ``-m settled.cli``, e.g. to run the command line with a fault."""
        log = self.workdir / f"{args[0]}-{len(self.procs)}.log"
        out = open(log, "wb")  # noqa: SIM115 - closed in stop_all
        self.files.append(out)
        proc = subprocess.Popen(
            [sys.executable, *launcher, *args],
            env=self.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            # a group of its own: whatever it forks (prefork children, an embedded beat) is
            # stopped with it, and never outlives the test
            start_new_session=True,
        )
        self.procs.append(proc)
        self.log_paths[proc.pid] = log
        return proc

    def log_of(self, proc: Proc) -> str:
        return self.log_paths[proc.pid].read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.workdir.glob("*-[0-9]*.log"))
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
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it left behind, if anything
        self.procs.clear()
        for f in self.files:
            f.close()
        self.files.clear()


def provider_env(
    mode: str, url: str, control: SimulatorControl, tenant: SimTenant
) -> dict[str, str]:
    """The ``SETTLED_*`` variables that send refunds to the simulator at ``url`` in ``mode``
    (``stripe``, ``wechatpay``, ``alipay``) as ``tenant``, its merchant or app registered
    there, for ``Stack(env_extra=...)``; the contracts those providers declare (none enforces
    the deadline), not the stack's fence."""
    fields: dict[str, Any] = {"downstream_providers": {"refund": mode}}
    if mode == "stripe":
        fields.update(
            stripe_api_keys={tenant.name: tenant.api_key}, stripe_api_base=url + STRIPE_PREFIX
        )
    elif mode == "wechatpay":
        fields.update(
            wechatpay_merchants={tenant.name: wechatpay.register(url, tenant.name)},
            wechatpay_api_base=url + WECHATPAY_PREFIX,
            wechatpay_order_totals="settled.simulator.control:order_total",
        )
    elif mode == "alipay":
        app = alipay.register_app(control, tenant.name)
        fields.update(
            alipay_app_ids={tenant.name: app.app_id},
            alipay_private_keys={tenant.name: app.private_key},
            alipay_public_keys={tenant.name: app.alipay_public_key},
            alipay_gateway_url=alipay.gateway_url(url),
        )
    else:
        raise ValueError(f"no provider mode {mode!r}")
    env = Settings(**fields).as_environment()
    wanted = {f"SETTLED_{name.upper()}" for name in fields}
    return {**{k: v for k, v in env.items() if k in wanted}, "SETTLED_DOWNSTREAM_CONTRACTS": "{}"}


@contextmanager
def embedded_stack(workdir: Path) -> Iterator[Stack]:
    """A stack on the embedded default in ``workdir``: a migrated SQLite file (the worker and
    beat refuse to start on a database never migrated) and the filesystem broker; its
    downstream answers nothing (so it declares no deadline fence, which a start probes). Every
    process it started is stopped on the way out."""
    url = f"sqlite:///{workdir / 'settled.sqlite3'}"
    upgrade(url)
    stack = Stack(
        database_url=url,
        broker_url="filesystem://",
        downstream_url="http://127.0.0.1:9",
        api_keys={},
        workdir=workdir,
        # It declares no deadline fence: nothing answers its probe at start.
        env_extra={
            "SETTLED_BROKER_FOLDER": str(workdir / "broker"),
            "SETTLED_DOWNSTREAM_CONTRACTS": "{}",
        },
    )
    try:
        yield stack
    finally:
        stack.stop_all()


class RedisProcess:
    """A Redis server of a test's own (no persistence), to kill and restart, or freeze and
    thaw, under a worker."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def answering(self) -> bool:
        """Running and not frozen."""
        return self.proc is not None and self.proc.poll() is None and not self.frozen

    def freeze(self) -> None:
        """SIGSTOP: it still accepts connections (the kernel does), and answers nothing."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def start(self) -> None:
        self.proc = spawn_redis(redis_binary(), self.port)
        wait_for_own_redis(self.proc, self.url)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash: whatever it held is gone (frozen or not)
            self.proc.wait(10)
        self.frozen = False
