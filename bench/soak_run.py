"""The fault soak's phases (``bench/soak.py``): start everything, start the producers, run
the chaos schedule, stop the faults, wait until everything settled, judge."""

from __future__ import annotations

import dataclasses
import heapq
import json
import multiprocessing
import queue
import time
from typing import Any

import psycopg

from bench import soak_producer
from bench.soak_chaos import SoakChaos
from bench.soak_judge import judge
from bench.soak_plan import DOWNSTREAM, KILLS, Action, chaos_schedule
from bench.soak_procs import LEASE_SECONDS, UNSETTLED, libpq


class Soak(SoakChaos):
    """One soak: ``run`` it, then ``close`` it."""

    def unsettled(self) -> int | None:
        try:
            with psycopg.connect(libpq(self.database_url), connect_timeout=2) as conn:
                row = conn.execute(UNSETTLED).fetchone()
        except psycopg.Error:
            return None
        return int(row[0]) if row else None

    def progress_line(self, committed: int) -> str:
        unsettled = self.unsettled()
        return (
            f"  t={self.timeline.now():7.1f} s  committed {committed:6d}/{self.args.ops}"
            f"  unsettled {'?' if unsettled is None else unsettled}"
        )

    def run(self) -> int:
        schedule = self.write_schedule()
        args = self.args
        print(
            f"soak: seed {self.seed}, {args.ops} operations, {args.duration:.0f} s of faults, "
            f"{args.producers} producers, default lease {LEASE_SECONDS:g} s; output in {self.out}",
            flush=True,
        )
        self.start_services()
        print(f"  services up after {self.timeline.now():.1f} s", flush=True)

        ctx = multiprocessing.get_context("spawn")
        progress = ctx.Value("i", 0)
        ready, go, shared_start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        producers = self.start_producers(ctx, progress, ready, go, shared_start)
        _wait_ready(producers, ready)
        start = shared_start.value = time.monotonic() + 0.2
        go.set()
        self.timeline.record("production_begins", "producers")
        _sleep_until(start)
        self.downstream(DOWNSTREAM)
        self.timeline.record("faults_begin", "downstream", probabilities=DOWNSTREAM)
        self.run_schedule(schedule, start, progress)
        self.wait(start + args.duration, progress)
        last_fault = self.end_faults()

        settled, settled_at = self.settle(producers, last_fault, progress)
        self._check_simulator()
        self.stop_processes()
        report = judge(self, last_fault=last_fault, settled=settled, settled_at=settled_at)
        return 0 if report["passed"] else 1

    def write_schedule(self) -> list[Action]:
        """The seeded chaos schedule, also written to ``schedule.json``."""
        args = self.args
        schedule = chaos_schedule(self.seed, args.duration, stop_seconds=LEASE_SECONDS + 3.0)
        (self.out / "schedule.json").write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "ops": args.ops,
                    "duration": args.duration,
                    "lease_seconds": LEASE_SECONDS,
                    "downstream": DOWNSTREAM,
                    "actions": [a.as_dict() for a in schedule],
                },
                indent=1,
            )
        )
        return schedule

    def start_producers(
        self, ctx: Any, progress: Any, ready: Any, go: Any, shared_start: Any
    ) -> list[Any]:
        """``--producers`` processes sharing ``--ops``, paced over 85 % of the fault window."""
        args = self.args
        produce = args.duration * 0.85
        quotas = [args.ops // args.producers] * args.producers
        quotas[0] += args.ops - sum(quotas)
        producers = []
        for i, quota in enumerate(quotas):
            cfg = soak_producer.ProducerConfig(
                index=i,
                seed=self.seed,
                quota=quota,
                rate=max(quota / produce, 0.001),
                database_url=self.database_url,
                broker_url=self.broker_url,
                fingerprint_key=self.fingerprint_key,
                idempotency_secret=self.idempotency_secret,
                result_path=str(self.out / f"producer-{i}.json"),
            )
            proc = ctx.Process(
                target=soak_producer.main,
                args=(cfg, progress, ready, go, shared_start),
                name=f"p{i}",
            )
            proc.start()
            producers.append(proc)
            self.timeline.record("start", f"producer-{i}", proc.pid, quota=quota)
        return producers

    def run_schedule(self, schedule: list[Action], start: float, progress: Any) -> None:
        """Each action at its time; a kind of kill skipped before it ever happened is tried
        once more a little later."""
        args = self.args
        todo = [(a.at, n, a) for n, a in enumerate(schedule)]
        heapq.heapify(todo)
        while todo:
            _, n, action = heapq.heappop(todo)
            self.wait(start + action.at, progress)
            self.act(action)
            self._check_simulator()
            if action.kind in KILLS and n < len(schedule):
                # A kind that has not happened yet and was skipped now (nothing running to
                # hit: everything just restarted) is tried once more a little later.
                happened = any(e["kind"] == action.kind for e in self.timeline.events)
                at = round(time.monotonic() - start + 3.0, 3)
                if not happened and at + action.length < args.duration - 1.0:
                    again = dataclasses.replace(action, at=at, pick=action.pick + 1000)
                    heapq.heappush(todo, (at, len(schedule) + n, again))
                    if action.kind == "stop_worker":
                        resume = Action(at + action.length, "resume_worker", "", again.pick)
                        heapq.heappush(todo, (resume.at, 2 * len(schedule) + n, resume))
                    self.timeline.record("retry_later", action.target, fault=action.kind, at=at)

    def end_faults(self) -> float:
        """No more downstream faults, held answers released, stopped workers resumed; returns
        the moment (monotonic)."""
        assert self.control is not None
        self.control.clear_rules()  # the schedule too
        self.control.release_holds()
        with self.lock:
            for pick, name in list(self.stopped_as.items()):
                self._resume_worker(Action(0.0, "resume_worker", name, pick))
        last_fault = time.monotonic()
        self.timeline.record("faults_end", "downstream")
        print(f"  faults stopped at t={self.timeline.now():.1f} s; waiting to settle", flush=True)
        return last_fault

    def settle(self, producers: list[Any], last_fault: float, progress: Any) -> tuple[bool, float]:
        """Wait, up to ``--settle-timeout`` after the last fault, for the producers to end and
        every operation to settle; producers still alive then are killed."""
        deadline = last_fault + self.args.settle_timeout
        for proc in producers:
            proc.join(max(0.0, deadline - time.monotonic()))
        settled = False
        if all(not p.is_alive() for p in producers):
            while not settled and time.monotonic() < deadline:
                settled = self.unsettled() == 0
                if not settled:
                    self.wait(min(deadline, time.monotonic() + 0.5), progress)
        settled_at = time.monotonic()
        self.timeline.record("settled" if settled else "unsettled", "operations")
        for proc in producers:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        return settled, settled_at

    def wait(self, until: float, progress: Any) -> None:
        """Wait until ``until`` (monotonic), printing progress every 5 s."""
        while True:
            now = time.monotonic()
            if now >= until:
                return
            if now >= self._last_print + 5.0:
                self._last_print = now
                print(self.progress_line(progress.value), flush=True)
            _sleep_until(min(until, self._last_print + 5.0))

    def _check_simulator(self) -> None:
        if self.simulator is not None and self.simulator.poll() is not None:
            raise RuntimeError(f"the simulator died (exit {self.simulator.returncode}): see logs")


def _sleep_until(when: float) -> None:
    wait = when - time.monotonic()
    if wait > 0:
        time.sleep(wait)  # the chaos schedule's own pacing


def _wait_ready(producers: list[Any], ready: Any) -> None:
    """Until every producer said it is ready (up to 120 s; at once if one died)."""
    waiting = len(producers)
    end = time.monotonic() + 120
    while waiting:
        try:
            ready.get(timeout=1.0)
            waiting -= 1
        except queue.Empty:
            dead = [p.name for p in producers if not p.is_alive()]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"producers not ready (dead: {dead}): see logs") from None
