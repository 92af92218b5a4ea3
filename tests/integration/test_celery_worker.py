"""Real Celery worker processes against PostgreSQL, Redis and the simulator.

The judge is the simulator's ledger: at most one business effect per operation, none lost.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from outbox import relay
from outbox.intake import CREATED_KEY, Outbox
from outbox.models import Operation, OperationEvent
from settled.celery_app import QUEUE, SUBMIT, create_app, hint_publisher, ids_publisher
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.support.judge import check_truthful
from tests.support.services import free_port
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import RedisProcess, Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

GOOD = {"order_id": "A1042", "amount_minor": 100, "currency": "CNY", "payee": "P-7"}
TERMINAL = {"succeeded", "rejected", "cancelled"}


class App:
    """The backend app: intake in its own transaction, hints published after commit."""

    def __init__(self, stack: Stack, engine: Engine, outbox: Outbox, **settings: Any) -> None:
        self.celery = create_app(stack.settings().model_copy(update=settings))
        self.publish = ids_publisher(self.celery)  # one hint of these ids, as the sweeper's
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        relay.install(self.sessions, hint_publisher(self.celery))
        self.outbox = outbox

    def enqueue(self, n: int, prefix: str = "op", **kw: Any) -> list[int]:
        ids = []
        with self.sessions.begin() as s:
            for i in range(n):
                got = self.outbox.enqueue(
                    s,
                    tenant="acme",
                    op_id=f"{prefix}-{i}",
                    kind="refund",
                    params={**GOOD, "amount_minor": 100 + i},
                    **kw,
                )
                ids.append(got.operation.id)
        return ids

    def states(self, ids: list[int]) -> dict[int, str]:
        with self.sessions() as s:
            rows = s.execute(select(Operation.id, Operation.state).where(Operation.id.in_(ids)))
            return {i: st for i, st in rows}

    def keys(self, ids: list[int]) -> list[str]:
        with self.sessions() as s:
            stmt = select(Operation.idempotency_key).where(Operation.id.in_(ids))
            return list(s.scalars(stmt))

    def path(self, op: int) -> list[str]:
        """The states an operation went through (state-changing events only)."""
        with self.sessions() as s:
            rows = s.execute(
                select(OperationEvent.from_state, OperationEvent.to_state)
                .where(OperationEvent.operation_id == op)
                .order_by(OperationEvent.id)
            ).all()
        return [to for frm, to in rows if frm != to]

    def close(self) -> None:
        self.celery.close()


@pytest.fixture
def broker_url(redis_url: str) -> str:
    return redis_url  # a Redis server of this test's own: empty at the start, gone at the end


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


@pytest.fixture
def app(stack: Stack, pg: Engine, outbox: Outbox, sim_control: SimulatorControl) -> Iterator[App]:
    a = App(stack, pg, outbox)
    yield a
    try:
        check_truthful(a.sessions, sim_control)  # every crash and fault test ends on this
    finally:
        a.close()


def wait_settled(app: App, stack: Stack, ids: list[int], timeout: float = 60.0) -> dict[int, str]:
    try:
        wait_until(lambda: set(app.states(ids).values()) <= TERMINAL, timeout, "operations settle")
    except BaseException:
        print(stack.logs())
        raise
    return app.states(ids)


def assert_at_most_one_effect(app: App, control: SimulatorControl, ids: list[int]) -> list[int]:
    counts = control.effect_counts("acme")
    effects = [counts[k] for k in app.keys(ids)]
    assert max(effects) <= 1, effects
    return effects


def test_operations_enqueued_in_a_transaction_are_sent_by_a_real_worker(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    port = free_port()
    stack.start_worker(pool="prefork", concurrency=2, beat=True, SETTLED_METRICS_PORT=str(port))
    ids = app.enqueue(20)
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 20
    # The worker serves metrics read from the database.
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
    assert 'settled_transitions_total{from_state="submitted",to_state="succeeded"} 20.0' in metrics
    assert 'settled_attempts_total{outcome="done"} 20.0' in metrics


@pytest.mark.parametrize("doorbell", [0, 8])
def test_a_commit_publishes_its_hints_in_messages_of_bounded_size(
    stack: Stack, pg: Engine, outbox: Outbox, broker_url: str, doorbell: int
) -> None:
    """Without the doorbell, and with it: a transaction of 45 operations carries its ids in
    three hints (a doorbell hint would claim fewer: SETTLED_CLAIM_BATCH=5)."""
    app = App(stack, pg, outbox, hint_doorbell=doorbell, claim_batch=5)
    client = redis.Redis.from_url(broker_url)
    try:
        ids = app.enqueue(45)
        messages = [json.loads(m) for m in client.lrange("settled", 0, -1)]
    finally:
        client.close()
        app.close()
    carried = [json.loads(base64.b64decode(m["body"]))[0][0] for m in messages]
    assert sorted(len(c) for c in carried) == [5, 20, 20]  # kombu pushes on the left
    assert sorted(i for c in carried for i in c) == sorted(ids)
    assert all(m["headers"]["task"] == SUBMIT for m in messages)


def test_publishing_builds_one_redis_client_not_one_per_message(
    app: App, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = []
    init = redis.Redis.__init__

    def counting_init(self: redis.Redis, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    app.publish([0])  # the connection and its channel, made once
    monkeypatch.setattr(redis.Redis, "__init__", counting_init)
    for i in range(1, 30):
        app.publish([i])
    monkeypatch.undo()
    assert len(built) <= 1, len(built)  # kombu's own channel made one per publish
    client = redis.Redis.from_url(broker_url)
    try:
        assert client.llen("settled") == 30
    finally:
        client.close()


def test_a_bare_id_hint_is_served_and_a_malformed_one_dropped(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    with app.sessions.begin() as s:  # no relay: the hints below are the only ones
        got = app.outbox.enqueue(s, tenant="acme", op_id="op-old", kind="refund", params=GOOD)
        s.info.pop(CREATED_KEY)
    op = got.operation.id
    app.celery.send_task(SUBMIT, args=["not-an-id"], queue=QUEUE)
    app.celery.send_task(SUBMIT, args=[[op, True]], queue=QUEUE)
    app.celery.send_task(SUBMIT, args=[op], queue=QUEUE)  # the format of earlier releases
    stack.start_worker(pool="solo")
    assert wait_settled(app, stack, [op]) == {op: "succeeded"}
    wait_until(lambda: stack.logs().count("malformed hint dropped") == 2, 30, "both dropped")
    (key,) = app.keys([op])
    assert sim_control.requests("acme", key) == 1


def test_beat_creates_the_folder_of_its_state_file_and_sweeps(
    app: App, stack: Stack, tmp_path: Path
) -> None:
    with app.sessions.begin() as s:  # no hint at all: only the sweeper can bring it
        got = app.outbox.enqueue(s, tenant="acme", op_id="op-swept", kind="refund", params=GOOD)
        s.info.pop(CREATED_KEY)
    schedule = tmp_path / "not" / "yet" / "celerybeat-schedule"
    stack.start_worker(beat=True, SETTLED_BEAT_SCHEDULE_FILE=str(schedule))
    op = got.operation.id
    assert wait_settled(app, stack, [op]) == {op: "succeeded"}
    assert schedule.parent.is_dir()


def test_rolled_back_intake_publishes_no_hint(app: App, stack: Stack, broker_url: str) -> None:
    with app.sessions() as s:
        app.outbox.enqueue(s, tenant="acme", op_id="op-x", kind="refund", params=GOOD)
        s.rollback()
    client = redis.Redis.from_url(broker_url)
    assert client.llen("settled") == 0
    ids = app.enqueue(1)
    assert client.llen("settled") == 1
    client.close()
    assert ids


def test_one_hint_delivered_five_times_sends_once(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    ids = app.enqueue(1)
    for _ in range(4):
        app.publish([ids[0]])
    stack.start_worker(pool="prefork", concurrency=2)
    assert wait_settled(app, stack, ids) == {ids[0]: "succeeded"}
    (key,) = app.keys(ids)
    wait_until(lambda: stack.logs().count("succeeded in") >= 5, 30, "all five hints consumed")
    assert sim_control.requests("acme", key) == 1
    assert sim_control.effects("acme", key) == 1


def test_two_workers_racing_give_one_effect_per_operation(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    ids = app.enqueue(40)
    for op in ids:  # every hint three times over, spread over both workers
        app.publish([op])
        app.publish([op])
    stack.start_worker(pool="prefork", concurrency=2, name="a", beat=True)
    stack.start_worker(pool="prefork", concurrency=2, name="b")
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 40
    assert [sim_control.requests("acme", k) for k in app.keys(ids)] == [1] * 40


def test_a_thread_pool_worker_works_concurrent_hints_together_once_each(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    """On the thread pool the hints of concurrent tasks are worked in shared batches
    (``workers.coalesce``, whose batching is tested in ``tests/unit/test_coalesce.py``): every
    operation settles, with one request and one effect."""
    ids = app.enqueue(30)
    for op in ids:  # one hint per operation, queued before the worker starts
        app.publish([op])
    stack.start_worker(pool="threads", concurrency=8)
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 30
    assert [sim_control.requests("acme", k) for k in app.keys(ids)] == [1] * 30


@pytest.mark.parametrize(
    ("step", "paths"),
    [
        # never sent: the lookup finds nothing, so unknown; the reconciler has it sent again
        # with the same key at once (a "not found" proves nothing yet), or, where its next look
        # comes once quiescence is over (this stack's fence: lease end + 2 s), requeues it
        # with the same key; either way it is sent once
        (
            "after_claim",
            [
                ["planned", "submitted", "unknown", "submitted", "succeeded"],
                ["planned", "submitted", "unknown", "planned", "submitted", "succeeded"],
            ],
        ),
        # sent, not recorded: the lookup finds the receipt
        ("after_send", [["planned", "submitted", "succeeded"]]),
        # recorded, not acked: the redelivered hint is a no-op
        ("after_outcome", [["planned", "submitted", "succeeded"]]),
    ],
)
def test_worker_sigkill_at_each_step_loses_nothing_and_duplicates_nothing(
    app: App,
    stack: Stack,
    sim_control: SimulatorControl,
    tmp_path: Path,
    step: str,
    paths: list[list[str]],
) -> None:
    marker = tmp_path / "failpoint-fired"
    victim = stack.start_worker(SETTLED_FAILPOINT=step, SETTLED_FAILPOINT_MARKER=str(marker))
    ids = app.enqueue(1)
    victim.wait(60)
    assert victim.returncode == -signal.SIGKILL
    assert marker.exists()
    stack.start_worker(beat=True)  # the sweeper and the reconciler bring the operation back
    wait_until(lambda: app.states(ids)[ids[0]] == "succeeded", 60, "operation succeeds")
    (key,) = app.keys(ids)
    assert sim_control.effects("acme", key) == 1
    assert sim_control.requests("acme", key) == 1
    assert app.path(ids[0]) in paths


def test_response_lost_after_commit_is_reconciled_on_beat(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("commit_then_timeout", hold_seconds=30, times=2)
    stack.start_worker(beat=True)
    ids = app.enqueue(2)
    wait_until(lambda: set(app.states(ids).values()) == {"succeeded"}, 60, "reconciled")
    assert [app.path(i) for i in ids] == [["planned", "submitted", "unknown", "succeeded"]] * 2
    assert assert_at_most_one_effect(app, sim_control, ids) == [1, 1]


def test_prefork_child_killed_mid_send_is_recovered_without_a_second_send(
    app: App, stack: Stack, sim_control: SimulatorControl, tmp_path: Path
) -> None:
    marker = tmp_path / "failpoint-fired"
    stack.start_worker(
        beat=True,
        pool="prefork",
        concurrency=1,
        SETTLED_FAILPOINT="after_send",
        SETTLED_FAILPOINT_MARKER=str(marker),
    )
    ids = app.enqueue(3)
    states = wait_settled(app, stack, ids)
    assert marker.exists()
    assert set(states.values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1, 1, 1]
    assert [sim_control.requests("acme", k) for k in app.keys(ids)] == [1, 1, 1]


def test_redis_flushed_mid_run_costs_latency_only(
    app: App, stack: Stack, sim_control: SimulatorControl, broker_url: str
) -> None:
    ids = app.enqueue(30)
    client = redis.Redis.from_url(broker_url)
    assert client.llen("settled") == 2  # 20 + 10 ids
    client.flushdb()  # every hint is lost
    client.close()
    stack.start_worker(beat=True, pool="prefork", concurrency=2)
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 30


#: Broker crashes in the restart test. One crash in about ten used to stop the worker's consumer
#: for good (kombu's channel close after the transport lost its client: see
#: tests/integration/test_broker_reconnect.py); the worker must survive any number.
RESTARTS = 6


def test_redis_restarted_under_a_running_worker_costs_latency_only(
    pg: Engine,
    outbox: Outbox,
    stack: Stack,
    sim_control: SimulatorControl,
) -> None:
    redis_server = RedisProcess()
    redis_server.start()
    own = dataclasses.replace(stack, broker_url=redis_server.url, procs=[], log_paths={})
    app = App(own, pg, outbox)
    try:
        worker = own.start_worker(beat=True, pool="prefork", concurrency=2)
        ids = app.enqueue(10, prefix="before")
        assert set(wait_settled(app, own, ids).values()) == {"succeeded"}
        for restart in range(RESTARTS):
            # Under load: hints in flight (delivered, not yet acknowledged) when Redis dies.
            busy = app.enqueue(4, prefix=f"busy-{restart}")
            redis_server.stop()
            during = app.enqueue(2, prefix=f"during-{restart}")  # hints lost: logged, not raised
            redis_server.start()  # empty: nothing survived
            after = app.enqueue(4, prefix=f"after-{restart}")  # the app's client reconnects
            # Settling them needs the worker consuming again (beat's hints come through Redis).
            batch = busy + during + after
            wait_until(
                lambda: (
                    set(app.states(batch).values()) <= TERMINAL  # noqa: B023
                    or worker.poll() is not None
                    or "Unrecoverable error" in own.log_of(worker)
                ),
                90,
                f"operations settle after restart {restart}",
            )
            assert worker.poll() is None, own.log_of(worker)[-4000:]
            assert "Unrecoverable error" not in own.log_of(worker), own.log_of(worker)[-4000:]
            assert set(app.states(batch).values()) == {"succeeded"}, restart
            ids += batch
        assert assert_at_most_one_effect(app, sim_control, ids) == [1] * len(ids)
    finally:
        own.stop_all()
        app.close()
        redis_server.stop()


def test_persistent_429_never_sends_more_than_max_attempts(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("429", retry_after="0")
    ids = app.enqueue(3, max_attempts=3)
    stack.start_worker(beat=True)
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"rejected"}
    assert [sim_control.requests("acme", k) for k in app.keys(ids)] == [3, 3, 3]
    assert assert_at_most_one_effect(app, sim_control, ids) == [0, 0, 0]


def test_retry_after_beyond_the_deadline_stops_after_one_send(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("429", retry_after="86400")
    ids = app.enqueue(2)
    stack.start_worker(beat=True)
    states = wait_settled(app, stack, ids)
    assert set(states.values()) == {"rejected"}
    assert [sim_control.requests("acme", k) for k in app.keys(ids)] == [1, 1]


def test_paused_worker_cannot_overwrite_the_newer_claims_result(
    app: App, stack: Stack, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("hold_before_commit", hold_seconds=30, times=1)
    # The downstream holds the send until the test releases it: it promises that much time
    # before a send is visible to lookups, so a "not found" never requeues it, however slowly
    # the fresh worker starts (with the default 2 s, a loaded machine saw a second request).
    # (The simulator refuses requests past their deadline: the contract declares the fence.)
    contract = {"processing_seconds": 15, "enforces_deadline": True}
    held = {"SETTLED_DOWNSTREAM_CONTRACTS": json.dumps({"refund": contract})}
    paused = stack.start_worker(name="paused", **held)
    ids = app.enqueue(1)
    (key,) = app.keys(ids)
    sim_control.wait_in_flight("acme", key, timeout=30)
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        stack.start_worker(beat=True, name="fresh", **held)
        # The lease expires; the fresh worker finds the send unrecorded, queries, finds
        # nothing yet (still held before commit) and records "unknown".
        wait_until(lambda: app.states(ids)[ids[0]] == "unknown", 30, "fresh claim settles")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
        sim_control.release_holds()  # the held request commits and answers the paused worker
    wait_until(lambda: "stale write refused" in stack.logs(), 30, "stale write refused")
    # The reconciler then finds the receipt the paused worker could not record.
    wait_until(lambda: app.states(ids)[ids[0]] == "succeeded", 30, "reconciled")
    with Session(app.sessions.kw["bind"]) as s:
        events = s.execute(
            select(OperationEvent.actor, OperationEvent.from_state, OperationEvent.to_state)
            .where(OperationEvent.operation_id == ids[0])
            .order_by(OperationEvent.id)
        ).all()
    paused_actor = events[1].actor  # it claimed the operation and sent it
    assert events[1].to_state == "submitted"
    assert all(e.actor != paused_actor for e in events[2:]), events
    assert events[-1].to_state == "succeeded"
    assert sim_control.effects("acme", key) == 1
    # Every other request was the reconciler's same-key resend of the unknown operation (while
    # the first was held: answered "in flight"; after: a replay), never a second effect.
    resends = sum(1 for e in events if (e.from_state, e.to_state) == ("unknown", "submitted"))
    assert sim_control.requests("acme", key) == 1 + resends


@pytest.mark.parametrize(
    "worker_env",
    [
        {"SETTLED_HINT_DOORBELL": "2", "SETTLED_CLAIM_BATCH": "4"},
        # a worker whose own settings turn the doorbell and the extra claims off still answers
        # the app's doorbell hints (with the defaults), instead of leaving them to the sweeper
        {"SETTLED_HINT_DOORBELL": "0", "SETTLED_CLAIM_BATCH": "0"},
    ],
    ids=["same-settings", "worker-off"],
)
def test_with_the_doorbell_a_backlog_of_one_op_commits_is_worked_from_two_hints(
    stack: Stack,
    pg: Engine,
    outbox: Outbox,
    broker_url: str,
    sim_control: SimulatorControl,
    worker_env: dict[str, str],
) -> None:
    """120 transactions of one operation each publish two doorbell hints (the limit); the
    worker, with no beat and so no sweeper, claims a batch at a time and rings again after each
    full claim: every operation is worked, once. Without the ringing again it would stop at the
    first two batches."""
    # Rings last 30 s on the app's side: none ages out while the backlog is committed.
    app = App(stack, pg, outbox, hint_doorbell=2, claim_batch=4, sweep_seconds=30)
    client = redis.Redis.from_url(broker_url)
    try:
        ids = [op for n in range(120) for op in app.enqueue(1, prefix=f"one-{n}")]
        messages = [json.loads(m) for m in client.lrange("settled", 0, -1)]
        carried = [json.loads(base64.b64decode(m["body"]))[0][0] for m in messages]
        assert carried == [[], []]
        stack.start_worker(pool="prefork", concurrency=2, **worker_env)
        assert set(wait_settled(app, stack, ids).values()) == {"succeeded"}
        assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 120
        # Then producers in threads commit while the worker works: none is left behind.
        with ThreadPoolExecutor(8) as pool:
            more = list(pool.map(lambda n: app.enqueue(1, prefix=f"live-{n}")[0], range(80)))
        assert set(wait_settled(app, stack, more).values()) == {"succeeded"}
        assert assert_at_most_one_effect(app, sim_control, more) == [1] * 80
        check_truthful(app.sessions, sim_control)
    finally:
        client.close()
        app.close()
