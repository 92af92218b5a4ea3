"""A step of the database's clock, on a PostgreSQL of the test's own whose clock the test sets
(Debian's libfaketime preloaded into the server, its offset read from a file at every call).

The failure covered: the clock jumps ahead while a worker's request is still held at the
downstream. In database time the worker's lease is over, so the reconciler takes the operation
over, and its lookup's "not found" (the request is in flight) looks quiet: it would requeue the
operation, whose budget is spent, so a worker rejects it; then the held request executes. The
judge is the simulator's ledger: "rejected" with an effect.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker

from outbox.db import make_engine, upgrade
from outbox.intake import Outbox
from outbox.models import ClockStep
from outbox.storage.operations import db_time
from settled.metrics import registry
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.conftest import truncate
from tests.integration.test_metrics import scrape
from tests.support import services
from tests.support.rig import GOOD, Rig
from tests.support.simtools import SimTenant

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
#: The worker's lease: its request is held at the downstream until its bound (lease less the
#: clock margin) or until the test releases it, whichever comes first.
LEASE = 12.0
STEP = 30.0


@dataclass
class SteppedDatabase:
    engine: Engine
    offset_file: Path

    def step(self, seconds: float) -> None:
        """Set the database's clock ``seconds`` away from the real time (read at every call)."""
        self.offset_file.write_text(f"{seconds:+.0f}\n")


@pytest.fixture(scope="module")
def stepped_server() -> Iterator[SteppedDatabase]:
    """A PostgreSQL whose clock the tests set, with a migrated database (one per module: a
    server takes seconds to start on a loaded machine)."""
    if not FAKETIME.exists():
        pytest.skip("libfaketime is not installed (apt-get install libfaketime; .ci/run does)")
    folder = Path(tempfile.mkdtemp(prefix="settled-faketime-"))
    offset = folder / "offset"
    offset.write_text("+0\n")
    folder.chmod(0o755)  # the server's user reads the offset at every call
    offset.chmod(0o644)
    env = {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    try:
        with (
            services.throwaway_postgres(env) as server,
            services.throwaway_database(server, "settled_stepped") as url,
        ):
            upgrade(url)
            engine = make_engine(url)
            try:
                yield SteppedDatabase(engine, offset)
            finally:
                engine.dispose()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def stepped(stepped_server: SteppedDatabase) -> Iterator[SteppedDatabase]:
    """The stepped database, its clock on time and its tables emptied after the test."""
    stepped_server.step(0)
    yield stepped_server
    stepped_server.step(0)
    truncate(stepped_server.engine)


@pytest.fixture
def stepped_rig(
    stepped: SteppedDatabase,
    outbox: Outbox,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    simulator: SimulatorHandle,
) -> Iterator[Rig]:
    """The rig on the stepped database, judged by the simulator's ledger at the end."""
    sim_control.create_order("acme", "A1042", 100000)
    sessions = sessionmaker(stepped.engine, expire_on_commit=False)
    rig = Rig(stepped.engine, outbox, sim_control, sim_tenant, simulator.url, sessions)
    try:
        yield rig
        rig.check_truthful()
    finally:
        sim_control.release_holds()
        rig.close()


def stepped_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("database clock stepped")]


@pytest.mark.postgres
def test_a_forward_step_is_seen_and_a_not_found_in_flight_is_not_trusted(
    stepped: SteppedDatabase, stepped_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig = stepped_rig
    metrics = registry(rig.sessions)
    scrape(metrics)  # counts from here
    op = rig.enqueue(max_attempts=1)
    key = rig.op(op).idempotency_key
    reconciler = rig.reconciler(worker="r1")
    reconciler.run_once()  # nothing due; it reads the database's clock before the step

    # A worker's request, held at the downstream (key in flight) until released.
    rig.control.add_rule("hold_before_commit", hold_seconds=LEASE, times=1)
    worker = rig.executor(lease_seconds=LEASE)
    worker.gateway = rig.gateway(timeout=2 * LEASE)  # bounded by the lease, not the client
    sending = threading.Thread(target=worker.execute, args=([op],))
    sending.start()
    rig.control.wait_in_flight("acme", key)

    stepped.step(STEP)
    with caplog.at_level(logging.WARNING, logger="outbox.clock_steps"):
        first = reconciler.run_once()  # the lease looks over: taken over, looked up
    assert first.outcomes == {"abandoned": 1}  # not found (in flight): unknown
    (seen,) = stepped_lines(caplog)
    assert (seen.direction, seen.detected_by) == ("forward", "reconciler:r1")  # type: ignore[attr-defined]
    assert abs(seen.step_seconds - STEP) < 3  # type: ignore[attr-defined]
    with rig.sessions() as s:
        (row,) = s.scalars(select(ClockStep)).all()
    assert (row.direction, row.detected_by) == ("forward", "reconciler:r1")
    samples = scrape(metrics)
    assert samples[("settled_db_clock_steps_total", (("direction", "forward"),))] == 1
    assert samples[("settled_db_clock_steps_total", (("direction", "backward"),))] == 0

    # Another process (a reconciler that saw no step itself) honours the recorded one; without
    # it this requeues, a worker rejects (budget spent), and the held request then executes.
    second = rig.reconciler(worker="r2").run_once()
    assert second.outcomes == {"wait_clock_step": 1}
    rig.executor(worker="w2").execute([op])  # a second hint: nothing to send or stop
    assert rig.op(op).state == "unknown"
    assert rig.sends(op) == 1

    rig.control.release_holds()  # the held request executes now
    sending.join(timeout=3 * LEASE)
    assert not sending.is_alive()
    rig.make_due(op)
    assert rig.reconciler(worker="r3").run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1


@pytest.mark.postgres
def test_a_backward_step_seen_by_a_worker_is_logged_and_recorded_for_every_process(
    stepped: SteppedDatabase, stepped_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig = stepped_rig
    first = rig.enqueue("op-1")
    worker = rig.executor(worker="w1")
    worker.execute([first])  # its claim reads the database's clock
    stepped.step(-STEP)
    second = rig.enqueue("op-2", {**GOOD, "amount_minor": 5})  # due in the new time base
    with caplog.at_level(logging.WARNING, logger="outbox.clock_steps"):
        worker.execute([second])  # so does this one: 30 s back
    (seen,) = stepped_lines(caplog)
    assert (seen.direction, seen.detected_by) == ("backward", "w1")  # type: ignore[attr-defined]
    with rig.sessions() as s:
        (row,) = s.scalars(select(ClockStep)).all()
        assert row.distrust_until > db_time(s)  # a lease from now, in the new time base
    assert (row.direction, row.detected_by) == ("backward", "w1")
    assert abs(row.step_seconds + STEP) < 3
    assert rig.op(first).state == "succeeded"
    # The simulator's clock did not step: to it, op-2's Settled-Deadline (database time, now
    # 30 s behind) has passed, so its fence refuses the request before any effect (408), and
    # the operation is planned again. A database clock off from the downstream's costs
    # latency, never a refund.
    assert rig.op(second).state == "planned"
    assert (rig.sends(second), rig.effects(second)) == (1, 0)
