"""The fault soak's chaos loop (``bench/soak.py``): each planned fault, kill or stop, done to
what runs, and the operations a worker held when it was killed or stopped."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime
from typing import Any

import psycopg
import redis

from bench.soak_plan import DOWNSTREAM, Action
from bench.soak_procs import CHILD_MIN_AGE, HOST, Service, age, child_pids, group_pids, libpq
from bench.soak_services import Recovery, SoakBase
from tests.support.services import wait_until


class SoakChaos(SoakBase):
    """The faults of the chaos schedule (``act``), done under the supervisor's lock."""

    def held(self, pids: list[int]) -> tuple[list[int], datetime | None]:
        """The live operations leased to these processes (executor or reconciler), and the
        database time, read just before they are killed or stopped."""
        owners = [f"{HOST}:{p}" for p in pids] + [f"reconciler:{HOST}:{p}" for p in pids]
        try:
            with psycopg.connect(libpq(self.database_url), connect_timeout=2, autocommit=True) as c:
                c.execute("SET statement_timeout = 3000")
                row = c.execute(
                    "SELECT clock_timestamp(), array(SELECT id FROM operations"
                    " WHERE lease_owner = ANY(%s) AND lease_until > clock_timestamp()"
                    " AND state IN ('planned', 'submitted', 'unknown') ORDER BY id)",
                    (owners,),
                ).fetchone()
        except psycopg.Error:
            return [], None
        assert row is not None
        return list(row[1]), row[0]

    def _other(self, name: str) -> str:
        pair = ("w1", "w2") if name.startswith("w") else ("b1", "b2")
        return pair[1] if name == pair[0] else pair[0]

    def _record_fault(
        self,
        a: Action,
        name: str,
        pid: int,
        held: list[int],
        db_time: datetime | None,
        **extra: Any,
    ) -> None:
        if not name.startswith(a.target):
            extra["planned_target"] = a.target  # it was not running: the other one was hit
        event = self.timeline.record(a.kind, name, pid, held=held, **extra)
        if db_time is not None and held:
            self.recoveries.append(Recovery(event, held, db_time))

    def act(self, a: Action) -> None:
        getattr(self, f"_{a.kind}")(a)

    def _on_worker(
        self, a: Action, act: Callable[[Service], None], *, need_children: bool = False
    ) -> None:
        """``act`` on the planned worker group, else on the other one, if it runs and is not
        stopped (with ``need_children``: has a prefork child ``CHILD_MIN_AGE`` old); waits up
        to 10 s for one that is just starting (without holding the supervisor's lock)."""
        end = time.monotonic() + 10.0
        while True:
            with self.lock:
                for name in (a.target, self._other(a.target)):
                    svc = self.services[name]
                    ready = svc.running() and not svc.stopped and svc.proc is not None
                    if ready and (not need_children or self._old_children(svc)):
                        act(svc)
                        return
            if time.monotonic() > end:
                self.timeline.record("skipped", a.target, fault=a.kind, why="nothing running")
                return
            time.sleep(0.2)

    @staticmethod
    def _old_children(svc: Service) -> list[int]:
        if svc.proc is None:
            return []
        return [c for c in child_pids(svc.proc.pid) if age(c) >= CHILD_MIN_AGE]

    def _kill_worker_group(self, a: Action) -> None:
        def kill(svc: Service) -> None:
            assert svc.proc is not None
            pgid = svc.proc.pid
            pids = group_pids(pgid)
            held, db_time = self.held(pids)
            os.killpg(pgid, signal.SIGKILL)
            svc.killed = True
            self._record_fault(a, svc.name, pgid, held, db_time, pids=pids)

        self._on_worker(a, kill)

    def _kill_worker_child(self, a: Action) -> None:
        def kill(svc: Service) -> None:
            assert svc.proc is not None
            # Read again: the children seen a moment ago may have exited since (recycled or
            # killed), and the list may be empty now.
            children = self._old_children(svc)
            if not children:
                self.timeline.record("skipped", svc.name, fault=a.kind, why="no child left")
                return
            child = children[a.pick % len(children)]
            held, db_time = self.held([child])
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            self._record_fault(a, f"{svc.name}/child", child, held, db_time, parent=svc.proc.pid)

        self._on_worker(a, kill, need_children=True)

    def _stop_worker(self, a: Action) -> None:
        def stop(svc: Service) -> None:
            assert svc.proc is not None
            pgid = svc.proc.pid
            pids = group_pids(pgid)
            held, db_time = self.held(pids)
            os.killpg(pgid, signal.SIGSTOP)
            svc.stopped = True
            self.stopped_as[a.pick] = svc.name
            self._record_fault(
                a, svc.name, pgid, held, db_time, pids=pids, seconds=round(a.length, 3)
            )

        self._on_worker(a, stop)

    def _resume_worker(self, a: Action) -> None:
        with self.lock:
            name = self.stopped_as.pop(a.pick, None)
            if name is None:
                return  # its stop was skipped
            svc = self.services[name]
            if svc.proc is not None:
                with suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGCONT)
            svc.stopped = False
            self.timeline.record("resume_worker", name, svc.pid)

    def _kill_beat(self, a: Action) -> None:
        with self.lock:
            for name in (a.target, self._other(a.target)):
                svc = self.services[name]
                if svc.running() and svc.proc is not None:
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.killed = True
                    self.timeline.record(a.kind, name, svc.proc.pid)
                    return
        self.timeline.record("skipped", a.target, fault=a.kind, why="no beat running")

    def _wait_up(self, name: str, a: Action) -> Service | None:
        svc = self.services[name]
        if not wait_until(svc.running, 10.0):
            self.timeline.record("skipped", name, fault=a.kind, why="not running")
            return None
        return svc

    def _kill_redis(self, a: Action) -> None:
        svc = self._wait_up("redis", a)
        if svc is None or svc.proc is None:
            return
        with self.lock:
            svc.proc.kill()
            svc.proc.wait(10)
            svc.killed = True
            self.timeline.record(a.kind, "redis", svc.proc.pid)

    def _flush_redis(self, a: Action) -> None:
        if self._wait_up("redis", a) is None:
            return
        client = redis.Redis.from_url(self.broker_url, socket_timeout=5)
        try:
            pid = client.info("server")["process_id"]
            keys = client.dbsize()
            client.flushall()
            self.timeline.record(a.kind, "redis", pid, keys=keys)
        except redis.RedisError as exc:
            self.timeline.record("skipped", "redis", fault=a.kind, why=type(exc).__name__)
        finally:
            client.close()

    def _restart_postgres(self, a: Action) -> None:
        svc = self._wait_up("postgres", a)
        if svc is None or self.cluster is None:
            return
        with self.lock:
            pid = self.cluster.postmaster_pid()
            self.cluster.stop("immediate")
            svc.killed = True
            self.timeline.record(a.kind, "postgres", pid, mode="immediate")

    def _lookup_outage_begin(self, a: Action) -> None:
        self.downstream({**DOWNSTREAM, "lookup_unavailable": 1.0})
        self.timeline.record(a.kind, "downstream", seconds=round(a.length, 3))

    def _lookup_outage_end(self, a: Action) -> None:
        self.downstream(DOWNSTREAM)
        self.timeline.record(a.kind, "downstream")

    def downstream(self, probabilities: dict[str, float]) -> None:
        assert self.control is not None
        self.control.set_schedule(
            self.seed, probabilities, retry_after="1", hold_seconds=self.hold_seconds
        )
