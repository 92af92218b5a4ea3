"""A downstream whose clock runs behind the database's, through the real executor and
reconciler against the simulator (its clock set back), on PostgreSQL and SQLite.

The failure covered (issue 44's review): each ``Settled-Deadline`` is in database time, so a
downstream 6 s behind accepts a request until 6 s after its header's deadline by the
database's clock, i.e. 5 s after its lease's end (the clock margin, 1 s, covers the rest). A
request a proxy held past the lease lands then; a reconciler trusting "not found" at the lease
end plus processing time would already have requeued the operation, whose one attempt is spent,
and a worker rejected it: "rejected", with the refund made. The judge is the simulator's ledger
(``check_truthful`` at the end of each test).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from outbox import wire
from outbox.clock_steps import ClockWatch
from outbox.downstream_clock import Episode
from outbox.errors import ReviewConflict
from outbox.models import DownstreamClockLag
from outbox.settings import Settings
from outbox.settings_contracts import ContractSettings
from outbox.states import State
from outbox.storage.downstream_clock import record_lag
from outbox.storage.operations import db_time
from reconciler.reconcile import Reconciler
from settled.metrics import registry
from settled.runtime import build_runtime, worker_name
from settled.simulator import SimulatorHandle
from settled.simulator.proxy import FaultProxy
from tests.integration.test_metrics import scrape
from tests.integration.test_review import ALICE, in_review, queue
from tests.support.rig import GOOD, RIG_CLIENT_TIMEOUT, Rig
from tests.support.simtools import wait_until
from workers.http_client import HttpGateway

#: The simulator's clock behind the database's, the executor's lease and the clock margin.
BEHIND, LEASE, MARGIN = 6.0, 3.0, 1.0


@pytest.fixture
def proxy(simulator: SimulatorHandle) -> Iterator[FaultProxy]:
    with FaultProxy(simulator.host, simulator.port) as proxy:
        yield proxy


@pytest.fixture
def behind(rig: Rig) -> Iterator[None]:
    """The simulator's clock ``BEHIND`` seconds behind (and put back after)."""
    rig.control.advance_clock(-BEHIND)
    yield
    rig.control.advance_clock(BEHIND)


def measured_gateway(rig: Rig, watch: ClockWatch, by: str, url: str | None = None) -> HttpGateway:
    """A gateway whose answers' time ``watch`` measures, recording episodes as ``by``."""
    keys = {rig.tenant.name: rig.tenant.api_key}
    gateway = HttpGateway(
        url or rig.url, keys, timeout=RIG_CLIENT_TIMEOUT, time_seen=rig.measured_by(watch, by)
    )
    rig.gateways.append(gateway)
    return gateway


def reconciler(rig: Rig, watch: ClockWatch) -> Reconciler:
    return Reconciler(
        sessions=rig.sessions,
        gateway=measured_gateway(rig, watch, "r1"),
        registry=rig.outbox.registry,
        worker="r1",
        client_timeout=1.0,
        clock_watch=watch,
    )


def lag_rows(rig: Rig) -> list[tuple[str, float, bool, str]]:
    with rig.sessions() as s:
        rows = s.execute(
            select(
                DownstreamClockLag.downstream,
                DownstreamClockLag.lag_seconds,
                DownstreamClockLag.begins,
                DownstreamClockLag.detected_by,
            ).order_by(DownstreamClockLag.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


@pytest.mark.usefixtures("behind")
def test_a_lag_measured_by_a_worker_is_logged_recorded_and_counted(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    reg = registry(rig.sessions)
    assert scrape(reg)[("settled_downstream_clock_lag_episodes_total", ())] == 0
    watch = ClockWatch(margin=MARGIN)
    executor = rig.executor(clock_watch=watch)
    executor.gateway = measured_gateway(rig, watch, "w1")
    with caplog.at_level(logging.INFO, logger="outbox.clock_steps"):
        first, second = rig.enqueue(), rig.enqueue("op-2", {**GOOD, "amount_minor": 5})
        started = time.monotonic()
        assert executor.execute([first]) == {first: State.SUCCEEDED}
        assert executor.execute([second]) == {second: State.SUCCEEDED}
        # each answer's round trip lies within this; the bound rounds up to a tenth
        slack = time.monotonic() - started + 0.1
    # Once per episode: one line, one row, one count, though two answers showed it.
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(":")[0] for r in warned] == [
        "downstream clock behind the database's beyond the clock margin"
    ]
    assert warned[0].downstream == "refund"  # type: ignore[attr-defined]
    assert BEHIND <= warned[0].lag_seconds <= BEHIND + slack  # type: ignore[attr-defined]
    ((downstream, lag, begins, by),) = lag_rows(rig)
    assert (downstream, begins, by) == ("refund", True, "w1")
    assert BEHIND <= lag <= BEHIND + slack
    assert scrape(reg)[("settled_downstream_clock_lag_episodes_total", ())] == 1
    # The reconciler's process reads what the worker recorded (a watch of its own, fresh).
    with rig.sessions() as s:
        seen = ClockWatch(margin=MARGIN).downstream_lag(s, "refund", datetime.now(UTC))
    assert seen == lag
    # Set right, the episode ends (logged) and nothing more is recorded.
    rig.control.advance_clock(BEHIND)
    try:
        with caplog.at_level(logging.INFO, logger="outbox.clock_steps"):
            third = rig.enqueue("op-3", {**GOOD, "amount_minor": 6})
            assert executor.execute([third]) == {third: State.SUCCEEDED}
    finally:
        rig.control.advance_clock(-BEHIND)
    assert "downstream clock back within the clock margin" in caplog.messages
    assert not watch.downstreams.beyond("refund")
    assert len(lag_rows(rig)) == 1


@pytest.mark.usefixtures("behind")
def test_a_not_found_waits_until_the_lag_is_covered_and_the_held_request_is_found(
    rig: Rig, proxy: FaultProxy
) -> None:
    """The review's case, end to end: a request held past its lease lands inside its header's
    deadline by the downstream's clock; the reconciler's "not found" asked before then is not
    trusted, and the landed request is found: never "rejected" with the refund made."""
    op = rig.enqueue(max_attempts=1)
    proxy.hold_requests()
    executor = rig.executor(url=proxy.url, lease_seconds=LEASE, clock_margin=MARGIN)
    executor.execute([op])
    assert rig.op(op).state == State.UNKNOWN and rig.sends(op) == 0  # held
    (attempt,) = rig.attempts(op)
    assert attempt.not_after is not None
    lease_end = attempt.not_after.replace(tzinfo=attempt.not_after.tzinfo or UTC).timestamp()
    # Past the lease's end plus the processing time (2 s): quiet, by the fence alone.
    wait_until(lambda: time.time() > lease_end + 2.1, 15, "the fence alone to call it quiet")
    watch = ClockWatch(margin=MARGIN)
    rig.make_due(op)
    started = time.monotonic()
    outcomes = reconciler(rig, watch).run_once().outcomes
    slack = time.monotonic() - started + 0.1  # the lookup's round trip lies within it
    # Its own lookup's answer measured the lag: the fence holds ~5 s later.
    assert outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == State.UNKNOWN
    lag = watch.downstreams.worst("refund", since=datetime.fromtimestamp(lease_end, UTC))
    assert lag is not None and BEHIND <= lag <= BEHIND + slack
    # The held request lands: still before its deadline by the downstream's clock.
    proxy.release()
    wait_until(lambda: proxy.answered == 1, 10, "the held request answered")
    assert rig.effects(op) == 1
    rig.make_due(op)
    assert reconciler(rig, watch).run_once().outcomes == {"found": 1}
    assert rig.op(op).state == State.SUCCEEDED


@pytest.mark.usefixtures("behind")
def test_once_the_measured_lag_is_covered_a_not_found_is_trusted(
    rig: Rig, proxy: FaultProxy
) -> None:
    """Nothing lands: the wait ends at the lease's end plus the lag beyond the margin plus
    processing, and the operation is sent again with its key (the fence stops the held one)."""
    op = rig.enqueue()
    proxy.hold_requests()
    rig.executor(url=proxy.url, lease_seconds=LEASE, clock_margin=MARGIN).execute([op])
    (attempt,) = rig.attempts(op)
    assert attempt.not_after is not None
    lease_end = attempt.not_after.replace(tzinfo=attempt.not_after.tzinfo or UTC).timestamp()
    watch = ClockWatch(margin=MARGIN)
    # The fence alone calls it quiet at the lease's end plus processing; the lookup's answer
    # measures the lag, and the look is put off until the lag beyond the margin is covered too.
    wait_until(lambda: time.time() > lease_end + 2.1, 15, "the fence alone to call it quiet")
    rig.make_due(op)
    assert reconciler(rig, watch).run_once().outcomes == {"wait_quiescence": 1}
    quiet = rig.op(op).next_attempt_at
    assert quiet.timestamp() >= lease_end + (BEHIND - MARGIN) + 2
    wait_until(lambda: time.time() > quiet.timestamp(), 20, "the lag to be covered")
    assert reconciler(rig, watch).run_once().outcomes == {"requeued": 1}
    proxy.release()  # past its deadline by the downstream's clock too: refused, no effect
    wait_until(lambda: proxy.answered == 1, 10, "the held request answered")
    assert rig.effects(op) == 0
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1


def test_staff_cannot_resolve_rejected_on_a_not_found_inside_a_recorded_lag(rig: Rig) -> None:
    """A lag a worker recorded reaches staff's lookup in another process: "rejected" on a
    "not found" is refused until the lease's end plus the lag beyond the margin is over."""
    op, item = in_review(rig, fault="reset_before")  # never executed downstream
    rig.age_attempts(op, 60)  # quiet by the fence alone: lease end + processing long past
    with rig.sessions.begin() as s:
        record_lag(s, Episode("refund", 120.0, True, db_time(s)), by="w9")
    why = "downstream has no record after 1 h; customer informed"
    with pytest.raises(ReviewConflict) as conflict:
        queue(rig).resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    assert (conflict.value.code, conflict.value.data["why"]) == ("not_found_unproven", "not_quiet")
    assert rig.op(op).state == "unknown"
    with rig.sessions.begin() as s:  # a smaller lag, within what has passed since
        s.execute(update(DownstreamClockLag).values(lag_seconds=30.0))
    queue(rig).resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    assert (rig.op(op).state, rig.effects(op)) == ("rejected", 0)


@pytest.mark.usefixtures("behind")
def test_the_runtimes_gateway_measures_every_answer_for_the_process(
    rig: Rig, settings: Settings
) -> None:
    """As every process builds it (``build_runtime``): the worker's sends are measured by the
    process's clock watch, and the episode recorded under the process's name."""
    configured = settings.model_copy(
        update={
            "database_url": rig.engine.url.render_as_string(hide_password=False),
            "downstream_url": rig.url,
            "downstream_api_keys": {rig.tenant.name: rig.tenant.api_key},
            "downstream_timeout": 1.0,
        }
    )
    runtime = build_runtime(configured)
    try:
        op = rig.enqueue()
        started = time.monotonic()
        assert runtime.executor.execute([op]) == {op: State.SUCCEEDED}
        took = time.monotonic() - started  # the answer's round trip lies within it
        assert runtime.clock_watch.downstreams.beyond("refund")
    finally:
        runtime.close()
    ((downstream, lag, begins, by),) = lag_rows(rig)
    assert (downstream, begins, by) == ("refund", True, worker_name())
    # the bound: the lag, plus at most the round trip, rounded up to a tenth of a second
    assert BEHIND <= lag <= BEHIND + took + 0.1


@pytest.mark.usefixtures("behind")
def test_the_runtimes_worker_tells_a_downstream_behind_a_deadline_that_much_earlier(
    rig: Rig, settings: Settings, proxy: FaultProxy
) -> None:
    """Once an answer measured the lag, each fenced send's ``Settled-Deadline`` is that much
    earlier, so the downstream's fence cuts at the lease's end less the margin in database
    time: a request held past its lease's end is refused there, where the uncorrected header
    (5 s later by the downstream's clock) would have let it land."""
    configured = settings.model_copy(
        update={
            "database_url": rig.engine.url.render_as_string(hide_password=False),
            "downstream_url": proxy.url,
            "downstream_api_keys": {rig.tenant.name: rig.tenant.api_key},
            "downstream_timeout": 1.0,
            "downstream_contracts": {"refund": ContractSettings(enforces_deadline=True)},
            "lease_seconds": LEASE,
            "clock_margin_seconds": MARGIN,
        }
    )
    runtime = build_runtime(configured)
    try:
        first = rig.enqueue()
        assert runtime.executor.execute([first]) == {first: State.SUCCEEDED}
        # Its header is not corrected: no answer had measured the lag yet.
        (row,) = rig.control.ledger()["requests"]
        told = wire.parse_deadline(row["last_deadline"])
        (attempt,) = rig.attempts(first)
        lease_end = attempt.not_after.replace(tzinfo=attempt.not_after.tzinfo or UTC)
        assert told is not None
        assert lease_end - timedelta(seconds=MARGIN + BEHIND) < told
        assert told <= lease_end - timedelta(seconds=MARGIN)
        proxy.hold_requests()
        second = rig.enqueue("op-2", {**GOOD, "amount_minor": 5})
        runtime.executor.execute([second])
    finally:
        runtime.close()
    assert rig.op(second).state == State.UNKNOWN and rig.sends(second) == 0  # held
    (attempt,) = rig.attempts(second)
    lease_end = attempt.not_after.replace(tzinfo=attempt.not_after.tzinfo or UTC)
    # Past the lease's end: 5 s before the uncorrected header's deadline by the downstream's
    # clock, after the corrected one's.
    wait_until(lambda: datetime.now(UTC) > lease_end + timedelta(seconds=0.1), 15, "lease end")
    proxy.release()
    wait_until(lambda: proxy.answered == 1, 10, "the held request answered")
    assert rig.effects(second) == 0
    key = rig.op(second).idempotency_key
    (row,) = [r for r in rig.control.ledger()["requests"] if r["idempotency_key"] == key]
    told = wire.parse_deadline(row["last_deadline"])
    assert told is not None
    assert told <= lease_end - timedelta(seconds=MARGIN + BEHIND)
