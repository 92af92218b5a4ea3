"""The app never waits on the broker (issue 45): commits whose hints meet a Redis frozen by
SIGSTOP, or one that refuses connections (killed), return while it is still down; their hints
are counted (``settled_hints_total``) and the outage logged once; a real Celery worker (prefork,
with beat's sweeper) settles every refund once Redis is back, exactly once by the simulator's
ledger. The Redis is the test's own, on a port of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine

from outbox.breaker import OUTCOMES
from outbox.intake import Outbox
from outbox.settings import Settings
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration.test_celery_worker import App, assert_at_most_one_effect, wait_settled
from tests.support.judge import check_truthful
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import RedisProcess, Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

#: intake transactions (one refund each) committed while Redis is down
COMMITS = 6
#: loggers of the app's side of Settled
OURS = ("outbox.", "settled.")
#: the bound an app's hint has in production (the setting's default)
PRODUCTION_HINT_TIMEOUT = Settings.model_fields["hint_timeout"].default
#: the app's cool-down after a failed hint: short, so that the test sees hints work again
COOLDOWN = 0.2


@pytest.fixture
def broker() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.thaw()  # a stopped process cannot be killed
    server.stop()


@pytest.fixture
def stack(
    pg_url: str,
    broker: RedisProcess,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> Iterator[Stack]:
    sim_control.create_order("acme", "A1042", 10**9)
    s = Stack(
        database_url=pg_url,
        broker_url=broker.url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    yield s
    s.stop_all()


@pytest.fixture(params=[4, 0], ids=["doorbell", "no-doorbell"])
def app(
    request: pytest.FixtureRequest,
    stack: Stack,
    pg: Engine,
    outbox: Outbox,
    sim_control: SimulatorControl,
) -> Iterator[App]:
    """The app, with the doorbell (its ring meets the broker first) and without it (the hint's
    publish does)."""
    a = App(
        stack,
        pg,
        outbox,
        hint_timeout=PRODUCTION_HINT_TIMEOUT,  # the stack's test settings give a second
        hint_cooldown_seconds=COOLDOWN,
        hint_doorbell=request.param,
    )
    yield a
    try:
        check_truthful(a.sessions, sim_control)
    finally:
        a.close()


def hint_counts() -> dict[str, float]:
    """This process's ``settled_hints_total`` by outcome (the app is this process)."""
    return {o: REGISTRY.get_sample_value("settled_hints_total", {"outcome": o}) or 0.0
            for o in OUTCOMES}  # fmt: skip


def commit_in_background(app: App, prefix: str) -> tuple[threading.Event, list[int]]:
    """``COMMITS`` intake transactions of one refund each, in a thread; the event is set once
    all of them returned (committed, their hints published or not)."""
    done, ids = threading.Event(), []

    def commit() -> None:
        for n in range(COMMITS):
            ids.extend(app.enqueue(1, prefix=f"{prefix}-{n}"))
        done.set()

    threading.Thread(target=commit, daemon=True).start()
    return done, ids


OUTAGES: dict[str, tuple[Callable[[RedisProcess], None], Callable[[RedisProcess], None]]] = {
    "frozen": (RedisProcess.freeze, RedisProcess.thaw),
    "refusing": (RedisProcess.stop, RedisProcess.start),  # back empty: every hint lost
}


@pytest.mark.parametrize("outage", list(OUTAGES))
def test_commits_return_while_redis_is_down_and_every_refund_settles_once_it_is_back(
    app: App,
    stack: Stack,
    broker: RedisProcess,
    sim_control: SimulatorControl,
    caplog: pytest.LogCaptureFixture,
    outage: str,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.breaker")
    begin, end = OUTAGES[outage]
    stack.start_worker(beat=True, pool="prefork", concurrency=2)
    ids = app.enqueue(4, prefix="before")
    assert set(wait_settled(app, stack, ids).values()) == {"succeeded"}
    counted = hint_counts()

    begin(broker)
    done, during = commit_in_background(app, outage)
    returned = done.wait(30)  # Redis stays down until the commits returned, or this gave up
    down = not broker.answering
    end(broker)
    assert returned, f"an app commit waited on the {outage} broker"
    assert down, "Redis came back before the commits returned"
    assert len(during) == COMMITS

    now = hint_counts()
    failed, skipped = now["failed"] - counted["failed"], now["skipped"] - counted["skipped"]
    assert now["published"] == counted["published"]  # none reached a broker that was down
    assert failed >= 1 and failed + skipped == COMMITS, (failed, skipped)
    # One line for the outage (the breaker's), none per hint (the relay's, the doorbell's).
    warnings = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(OURS)
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]

    # Delivery falls to the sweeper: the worker settles each of them once Redis is back.
    assert set(wait_settled(app, stack, during, timeout=90).values()) == {"succeeded"}
    # The next commits' hints go out again: the outage's one INFO line says what it cost.
    after: list[int] = []

    def commit_and_see_hints_again() -> bool:
        after.extend(app.enqueue(1, prefix=f"after-{len(after)}"))
        return any(r.levelname == "INFO" for r in caplog.records)

    wait_until(commit_and_see_hints_again, 30, "a hint published after the outage")
    (back,) = [r for r in caplog.records if r.levelname == "INFO"]
    final = hint_counts()  # the outage's hints, those skipped after Redis was back included
    cost = (final["skipped"] - counted["skipped"], final["failed"] - counted["failed"])
    assert (back.skipped, back.failed) == cost  # type: ignore[attr-defined]
    assert final["published"] > now["published"]
    ids += during + after
    assert set(wait_settled(app, stack, ids).values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * len(ids)  # 0 lost, 0 dup
