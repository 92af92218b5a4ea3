"""A ``sentinel://`` broker (``SETTLED_REDIS_SENTINEL_MASTER``): a real worker, the app's
hints and the doorbell on the master a Redis Sentinel names, and after a failover on the
new one. Judged by the operations table and the simulator's ledger."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.intake import Outbox
from outbox.settings import Settings
from settled.celery_app import QUEUE, broker_redis, check_broker
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration.test_celery_worker import App, assert_at_most_one_effect, wait_settled
from tests.support.load import Producer, judge_committed
from tests.support.sentinel import MASTER_NAME, RedisSentinel
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


class SentinelStack(Stack):
    def settings(self) -> Settings:
        """The app's settings: the stack's, with the master's name."""
        return Settings(
            database_url=self.database_url,
            broker_url=self.broker_url,
            downstream_url=self.downstream_url,
            fingerprint_keys={"v1": "test-fingerprint-key-0001"},  # type: ignore[dict-item]
            idempotency_secret="test-idempotency-secret",  # type: ignore[arg-type]
            redis_sentinel_master=MASTER_NAME,
        )


@pytest.fixture
def sentinel(request: pytest.FixtureRequest) -> Iterator[RedisSentinel]:
    servers = RedisSentinel(replica=getattr(request, "param", False))
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def stack(
    pg: Engine,
    pg_url: str,
    sentinel: RedisSentinel,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> Iterator[Stack]:
    sim_control.create_order("acme", "A1042", 10**9)
    s = SentinelStack(
        database_url=pg_url,
        broker_url=sentinel.url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
        env_extra={"SETTLED_REDIS_SENTINEL_MASTER": MASTER_NAME},
    )
    yield s
    s.stop_all()


@pytest.fixture
def app(stack: Stack, pg: Engine, outbox: Outbox) -> Iterator[App]:
    a = App(stack, pg, outbox)
    yield a
    a.close()


def test_a_worker_on_a_sentinel_url_sends_each_refund_once(
    app: App, stack: Stack, sentinel: RedisSentinel, sim_control: SimulatorControl
) -> None:
    """No beat: only the app's hints (its doorbell and its publishes, through the Sentinel)
    reach the worker."""
    settings = stack.settings()
    check_broker(settings)  # the preflight reaches the master through the Sentinel
    stack.start_worker(beat=False, pool="threads", concurrency=2)
    ids = app.enqueue(3)
    assert set(wait_settled(app, stack, ids).values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1, 1, 1]
    # The hints and the doorbell's count lived on the master the Sentinel named.
    master = sentinel.master()
    assert master.exists(f"_kombu.binding.{QUEUE}")
    client = broker_redis(settings)
    assert client is not None
    assert client.connection_pool.connection_kwargs.get("port") is None  # found, not configured
    assert client.info("server")["tcp_port"] == sentinel.master_port()


def test_a_sentinel_url_without_the_master_name_is_refused_at_start(
    stack: Stack,
) -> None:
    del stack.env_extra["SETTLED_REDIS_SENTINEL_MASTER"]
    proc = stack.start_worker()
    proc.wait(60)
    log = stack.log_of(proc)
    assert proc.returncode != 0
    assert "is a sentinel:// URL: set SETTLED_REDIS_SENTINEL_MASTER" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("sentinel", [True], indirect=True, ids=["with-replica"])
def test_after_a_sentinel_failover_the_next_refund_is_sent_once(
    app: App, stack: Stack, sentinel: RedisSentinel, sim_control: SimulatorControl
) -> None:
    """``SENTINEL FAILOVER`` promotes the replica while the worker runs, and the old master
    dies: the worker, the app's publishes and beat's sweeper follow the Sentinel to the new
    master, and the next refunds are done, once each."""
    stack.start_worker(beat=True, pool="threads", concurrency=2)
    first = app.enqueue(1, prefix="before")
    assert set(wait_settled(app, stack, first).values()) == {"succeeded"}
    old = sentinel.master_port()
    new = sentinel.failover()
    assert new != old
    sentinel.kill(old)  # nothing can still be served by the old master
    after = app.enqueue(2, prefix="after")
    assert set(wait_settled(app, stack, after).values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, first + after) == [1, 1, 1]


@pytest.mark.parametrize("sentinel", [True], indirect=True, ids=["with-replica"])
def test_the_master_killed_under_load_the_sentinel_fails_over_and_no_refund_is_lost(
    app: App,
    stack: Stack,
    outbox: Outbox,
    sentinel: RedisSentinel,
    sim_control: SimulatorControl,
) -> None:
    """The broker's master crashes (SIGKILL) while the app commits one refund per
    transaction and a real worker (prefork, with beat's sweeper) sends them: the Sentinel
    finds it down (2 s) and promotes the replica; the app, the worker and the sweeper follow.
    Judged by the ledger: every refund the app saw committed is done exactly once (a hint lost
    with the old master is the sweeper's to deliver), every state true."""
    worker = stack.start_worker(beat=True, pool="prefork", concurrency=2)
    wait_until(lambda: " ready." in stack.log_of(worker), 60, "the worker's start")
    producer = Producer(app, outbox)
    try:
        producer.start()
        # The crash comes while the worker sends: refunds are being done at the simulator.
        wait_until(lambda: len(sim_control.effect_counts("acme")) >= 15, 60, "refunds done")
        old = sentinel.master_port()
        at_kill = producer.mark()
        sentinel.kill(old)
        wait_until(lambda: sentinel.master_port() != old, 60, "the Sentinel to fail over")
        assert producer.marked is not None
        failover = time.monotonic() - producer.marked
        promoted = len(producer.committed)
        wait_until(
            lambda: (
                len(producer.committed) >= max(promoted, at_kill) + 15 or producer.error is not None
            ),
            60,
            "the load after the failover",
        )
        producer.finish()
        ids = judge_committed(app, stack, producer, sim_control)
        print(
            f"sentinel failover under load: the new master named {failover:.1f} s after the "
            f"crash; {len(ids)} refunds, 0 lost, 0 sent twice"
        )
    except BaseException:
        print(stack.logs())
        raise
    finally:
        producer.stopping.set()


def test_the_master_name_is_required_with_sentinels_and_refused_without() -> None:
    for bad, says in [
        ({"broker_url": "sentinel://127.0.0.1:26390"}, "set SETTLED_REDIS_SENTINEL_MASTER"),
        (
            {"broker_url": "redis://127.0.0.1:6399/0", "redis_sentinel_master": "m"},
            "is not a sentinel:// URL",
        ),
        ({"broker_url": "redis+cluster://127.0.0.1:7000"}, "Redis Cluster is not supported"),
    ]:
        with pytest.raises(ValueError, match=says):
            Settings(**bad)  # type: ignore[arg-type]
