"""Batched claims and outcomes: one claim transaction, concurrent sends, one outcome transaction,
each outcome still fenced by its own lease version; a dead pooled connection costs one retry;
a slow send holds up no other outcome, and a slow ring again (the doorbell) no send."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, select, update
from sqlalchemy.orm import sessionmaker

from outbox.db import make_engine
from outbox.downstream import DownstreamRequest, Gateway, SubmitOutcome
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.states import Event, RejectReason, State
from outbox.storage.attempts import start_attempts
from outbox.storage.claims import Claimed, claim_for_send, claim_unresolved
from outbox.storage.transitions import Finish, Transition
from tests.support.rig import GOOD, Rig
from tests.support.services import wait_until


def enqueue_many(rig: Rig, n: int) -> list[int]:
    return [rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(n)]


class TakeOverDuring:
    """Sends through ``inner``; while one key is in flight, another worker takes its lease over."""

    def __init__(self, inner: Gateway, rig: Rig, victim: int) -> None:
        self.inner = inner
        self.rig = rig
        self.victim = victim
        self.key = rig.op(victim).idempotency_key

    def submit(self, request: DownstreamRequest, /, *, deadline: datetime) -> SubmitOutcome:
        outcome = self.inner.submit(request, deadline=deadline)
        if request.idempotency_key == self.key:  # the sender paused past its lease; a newer claim
            with self.rig.sessions.begin() as s:
                s.execute(
                    update(Operation)
                    .where(Operation.id == self.victim)
                    .values(lease_until=datetime.now(UTC) - timedelta(seconds=1))
                )
            with self.rig.sessions.begin() as s:
                (new,) = claim_unresolved(s, worker="other", lease_seconds=60, limit=1)
                lost = Transition(new, Event.LOSE, State.UNKNOWN)
                self.rig.storage.write_transition(s, lost, actor="other")
        return outcome

    def lookup(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        return self.inner.lookup(request, **kw)


def test_a_stale_lease_in_a_batch_skips_that_operation_only(rig: Rig) -> None:
    ids = enqueue_many(rig, 4)
    victim = ids[2]
    executor = rig.executor(batch_extra=3)
    executor.gateway = TakeOverDuring(rig.gateway(), rig, victim)
    written = executor.execute([ids[0]])
    assert written == {i: State.SUCCEEDED for i in ids if i != victim}
    for i in ids:
        assert rig.effects(i) == 1 and rig.sends(i) == 1
    assert all(rig.op(i).state == "succeeded" for i in ids if i != victim)
    assert all(rig.attempts(i)[0].proof == "done" for i in ids if i != victim)
    # The newer claim's verdict stands; the stale worker wrote nothing for it.
    assert rig.op(victim).state == "unknown"
    assert rig.attempts(victim)[0].proof is None
    with rig.sessions() as s:
        actors = s.scalars(
            select(OperationEvent.actor)
            .where(OperationEvent.operation_id == victim)
            .order_by(OperationEvent.id)
        ).all()
    assert actors[1:] == ["w1", "other"]  # claim by w1, verdict by the newer claim


@pytest.fixture
def commits(engine: Engine) -> Iterator[list[int]]:
    counted = [0]

    def count(_conn: Any) -> None:
        counted[0] += 1

    event.listen(engine, "commit", count)
    yield counted
    event.remove(engine, "commit", count)


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_a_batch_costs_one_claim_and_one_outcome_transaction(rig: Rig, commits: list[int]) -> None:
    """Elsewhere than on PostgreSQL (the next test), a step is one transaction."""
    ids = enqueue_many(rig, 5)
    commits[0] = 0
    # Answers come back spread out on a loaded machine: waited for (one outcome step) as long
    # as it takes, whatever the load (that none waits for a slow one is tested below).
    written = rig.executor(batch_extra=4, record_linger=10.0).execute([ids[0]])
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    assert commits[0] == 2
    assert [rig.sends(i) for i in ids] == [1] * 5


def test_hints_for_operations_a_batch_already_took_send_nothing(rig: Rig) -> None:
    ids = enqueue_many(rig, 3)
    executor = rig.executor(batch_extra=2)
    assert executor.execute([ids[0]]) == dict.fromkeys(ids, State.SUCCEEDED)
    assert [executor.execute([i]) for i in ids[1:]] == [{}, {}]
    assert [rig.sends(i) for i in ids] == [1, 1, 1]


def test_a_doorbell_hint_claims_the_oldest_due_and_rings_again_only_when_full(rig: Rig) -> None:
    ids = enqueue_many(rig, 5)
    executor = rig.executor(batch_extra=3)
    calls: list[list[int]] = []

    def when_full() -> None:  # called after the claim committed (beside the sends)
        calls.append([rig.op(i).state != "planned" for i in ids])

    assert executor.execute([], when_full=when_full) == dict.fromkeys(ids[:3], State.SUCCEEDED)
    assert calls == [[True, True, True, False, False]]
    assert executor.execute([], when_full=when_full) == dict.fromkeys(ids[3:], State.SUCCEEDED)
    assert len(calls) == 1  # two of three: nothing due is left behind
    assert executor.execute([ids[0]], when_full=when_full) == {}  # a hint with ids never rings
    assert len(calls) == 1
    assert [rig.sends(i) for i in ids] == [1] * 5


def test_a_ring_again_slower_than_the_lease_costs_the_batch_no_send_and_no_attempt(
    rig: Rig,
) -> None:
    """The broker takes two leases to take the ring (as the executor's clock sees it): the
    claimed batch is still sent within its lease and succeeds, with one attempt each, even
    with ``max_attempts=1`` (a ring before the sends left them all ``rejected``, unsent)."""
    lease = 3.0
    ids = [
        rig.enqueue(f"op-{i}", {**GOOD, "amount_minor": 100 + i}, max_attempts=1) for i in range(3)
    ]
    ahead = [0.0]  # what the executor's monotonic clock runs ahead of the real one
    executor = rig.executor(
        batch_extra=3, lease_seconds=lease, monotonic=lambda: time.monotonic() + ahead[0]
    )
    rang = []

    def slow_broker() -> None:
        # Answers once the batch is recorded (or after two leases); then the time it took is
        # two leases: nothing the executor does after the ring may count on its lease.
        rang.append(wait_until(lambda: all(rig.op(i).state != "submitted" for i in ids), 2 * lease))
        ahead[0] += 2 * lease

    written = executor.execute([], when_full=slow_broker)
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    assert rang == [True]  # rung once, and the batch was recorded while the ring was out
    assert [(rig.op(i).state, rig.op(i).attempts) for i in ids] == [("succeeded", 1)] * 3
    assert [(rig.sends(i), rig.effects(i)) for i in ids] == [(1, 1)] * 3


def test_a_ring_again_that_fails_is_logged_and_costs_the_batch_nothing(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    ids = enqueue_many(rig, 2)

    def broken() -> None:
        raise RuntimeError("the broker is gone")

    written = rig.executor(batch_extra=2).execute([], when_full=broken)
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    assert "ringing again failed" in caplog.text


class HoldAnswer:
    """Sends through ``inner``; the answer to one key is held (a response trickling in) until
    ``release`` is set."""

    def __init__(self, inner: Gateway, key: str) -> None:
        self.inner = inner
        self.key = key
        self.release = threading.Event()

    def submit(self, request: DownstreamRequest, /, **kw: Any) -> SubmitOutcome:
        outcome = self.inner.submit(request, **kw)
        if request.idempotency_key == self.key:
            assert self.release.wait(30), "the held answer was never released"
        return outcome

    def lookup(self, request: DownstreamRequest, /, **kw: Any) -> Any:
        return self.inner.lookup(request, **kw)


@pytest.mark.parametrize("n", [2, 5])  # two: the smallest batch sent a thread each
def test_one_slow_answer_does_not_hold_up_the_other_outcomes_of_its_batch(rig: Rig, n: int) -> None:
    """Operations sent together, the answer to one held: the others are written (visible in
    the database) while it is still out; it is written when it comes back."""
    ids = enqueue_many(rig, n)
    slow = ids[n // 2]
    executor = rig.executor(batch_extra=n - 1)
    gateway = HoldAnswer(rig.gateway(), rig.op(slow).idempotency_key)
    executor.gateway = gateway
    written: dict[int, State] = {}
    worker = threading.Thread(target=lambda: written.update(executor.execute([ids[0]])))
    worker.start()
    try:
        others = [i for i in ids if i != slow]
        recorded = wait_until(lambda: all(rig.op(i).state == "succeeded" for i in others), 10)
        assert recorded, [rig.op(i).state for i in ids]
        assert rig.op(slow).state == "submitted"  # its answer is still out
        assert rig.sends(slow) == 1
    finally:
        gateway.release.set()
        worker.join(30)
    assert not worker.is_alive()
    assert written == dict.fromkeys(ids, State.SUCCEEDED)
    assert [rig.op(i).state for i in ids] == ["succeeded"] * n
    assert [(rig.sends(i), rig.effects(i)) for i in ids] == [(1, 1)] * n
    assert all(rig.attempts(i)[0].proof == "done" for i in ids)


def test_a_lone_send_waits_for_no_other_threads_send(rig: Rig) -> None:
    """An executor sending one operation at a time (``max_batch=1``) from two threads at once
    (as the coalescer's two runners do): a lone send is sent by the thread that claimed it,
    so a slow answer to one holds up no send of the other."""
    slow, other = enqueue_many(rig, 2)
    executor = rig.executor(max_batch=1, batch_extra=0)
    gateway = HoldAnswer(rig.gateway(), rig.op(slow).idempotency_key)
    executor.gateway = gateway
    threads = [threading.Thread(target=executor.execute, args=([op],)) for op in (slow, other)]
    threads[0].start()
    try:
        assert wait_until(lambda: rig.sends(slow) == 1, 10)  # out, its answer held
        threads[1].start()
        assert wait_until(lambda: rig.op(other).state == "succeeded", 10)
        assert rig.op(slow).state == "submitted"
    finally:
        gateway.release.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(30)
    assert [rig.op(i).state for i in (slow, other)] == ["succeeded", "succeeded"]
    assert [(rig.sends(i), rig.effects(i)) for i in (slow, other)] == [(1, 1), (1, 1)]


def test_a_doorbell_hint_claims_as_many_as_it_is_told_whatever_the_extra_claims(rig: Rig) -> None:
    ids = enqueue_many(rig, 3)
    executor = rig.executor(batch_extra=0)  # this worker's own SETTLED_CLAIM_BATCH=0
    assert executor.execute([]) == {}
    assert executor.execute([], claims=2) == dict.fromkeys(ids[:2], State.SUCCEEDED)
    assert executor.execute([ids[2]], claims=2) == {ids[2]: State.SUCCEEDED}  # ids: as hinted


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)  # backend pids: PostgreSQL
def test_a_dead_pooled_connection_costs_one_retry_not_the_operation(
    rig: Rig, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(pg_url, pool_pre_ping=False, pool_size=1)
    try:
        executor = rig.executor()
        executor.sessions = sessionmaker(engine, expire_on_commit=False)
        first, second = enqueue_many(rig, 2)
        assert executor.execute([first]) == {first: State.SUCCEEDED}
        with engine.connect() as conn:  # the pooled connection the executor will get again
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(libpq, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert executor.execute([second]) == {second: State.SUCCEEDED}
        assert "database connection lost" in caplog.text
        assert rig.sends(second) == 1 and rig.effects(second) == 1
    finally:
        engine.dispose()


@pytest.fixture
def statements(engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if not statement.startswith("BEGIN"):  # SQLite's explicit transaction start
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    yield seen
    event.remove(engine, "before_cursor_execute", count)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_batch_costs_three_statements_whatever_its_size(
    rig: Rig, statements: list[str], commits: list[int]
) -> None:
    """Claim, start and outcome writes are set-based, one statement each: no statement per
    operation. The claim and the start commit together (one commit); the outcomes, one
    statement, on an autocommit connection (no BEGIN or COMMIT round trip)."""
    counts = []
    for size, prefix in ((2, "small"), (12, "large")):
        ids = [rig.enqueue(f"{prefix}-{i}", {**GOOD, "amount_minor": 100 + i}) for i in range(size)]
        statements.clear()
        commits[0] = 0
        # (answers waited for together whatever the load, as in the test above)
        executor = rig.executor(record_linger=10.0)
        assert executor.execute(ids) == dict.fromkeys(ids, State.SUCCEEDED)
        counts.append((len(statements), commits[0]))
        assert [rig.sends(i) for i in ids] == [1] * size
        assert all(rig.attempts(i)[0].proof == "done" for i in ids)
        assert all(rig.op(i).downstream_ref for i in ids)
    # the claim; to submitted with events and attempts; the outcomes with events and attempts
    assert counts == [(3, 1), (3, 1)], statements


def test_a_claim_step_that_fails_before_its_sends_start_leaves_nothing_claimed(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim and the start of its sends commit together: a step that fails between them
    (a lost connection, a crash) takes its claim back with it, so the operation is free at
    once, not leased until the lease runs out; and nothing was sent."""
    (op,) = enqueue_many(rig, 1)

    def fail(*_: Any, **__: Any) -> list[Claimed]:
        raise RuntimeError("the step fails after the claim")

    monkeypatch.setattr("workers.claiming.start_attempts", fail)
    with pytest.raises(RuntimeError):
        rig.executor(worker="w1").execute([op])
    row = rig.op(op)
    assert (row.state, row.lease_owner, row.lease_version) == ("planned", None, 0)
    assert rig.sends(op) == 0
    monkeypatch.undo()
    assert rig.executor(worker="w2").execute([op]) == {op: State.SUCCEEDED}
    assert rig.sends(op) == 1


def test_a_batch_with_a_stale_fence_writes_the_others_and_their_events(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.judged_by_ledger = False  # storage-level: outcomes written by hand, nothing was sent
    ids = enqueue_many(rig, 3)
    with rig.sessions.begin() as s:
        claims = claim_for_send(s, worker="w1", lease_seconds=60, ids=ids)
        started = start_attempts(rig.storage, s, claims, worker="w1")
    with rig.sessions.begin() as s:  # a newer claim bumps the fence of the middle one
        s.execute(
            update(Operation)
            .where(Operation.id == ids[1])
            .values(lease_version=Operation.lease_version + 1)
        )
    accepted = [
        Transition(c, Event.ACCEPT, State.SUCCEEDED, receipt={"reference": f"r-{c.id}"})
        for c in started
    ]
    finishes = [Finish(c, "done", 200, {"reference": f"r-{c.id}"}) for c in started]
    with rig.sessions.begin() as s:
        written = rig.storage.write_transitions(s, accepted, actor="w1", finishes=finishes)
    assert written == {ids[0], ids[2]}
    assert caplog.text.count("stale write refused") == 1
    assert [rig.op(i).state for i in ids] == ["succeeded", "submitted", "succeeded"]
    assert [rig.op(i).downstream_ref for i in ids] == [f"r-{ids[0]}", None, f"r-{ids[2]}"]
    assert [rig.attempts(i)[0].proof for i in ids] == ["done", None, "done"]
    with rig.sessions() as s:
        last = {
            i: s.scalars(
                select(OperationEvent.to_state)
                .where(OperationEvent.operation_id == i)
                .order_by(OperationEvent.id.desc())
            ).first()
            for i in ids
        }
    assert last == {ids[0]: "succeeded", ids[1]: "submitted", ids[2]: "succeeded"}


def test_a_stale_lease_on_a_lone_operation_is_refused_once_and_written_by_nobody_else(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    (op,) = enqueue_many(rig, 1)
    executor = rig.executor()
    executor.gateway = TakeOverDuring(rig.gateway(), rig, op)
    assert executor.execute([op]) == {}
    assert caplog.text.count("stale write refused") == 1
    assert rig.op(op).state == "unknown"  # the newer claim's verdict stands
    assert rig.attempts(op)[0].proof is None


LATER = datetime.now(UTC) + timedelta(days=1)


def _outcomes(started: list[Claimed]) -> list[Transition]:
    """One transition of each shape the executor and the reconciler write after a send."""
    a, b, c, d, e, f = started
    return [
        Transition(a, Event.ACCEPT, State.SUCCEEDED, receipt={"reference": "r-1", "amount": 5}),
        Transition(b, Event.DEFER, State.PLANNED, evidence={"status": 503}, next_attempt_at=LATER),
        Transition(c, Event.LOSE, State.UNKNOWN, evidence={"error": "ReadTimeout"}),
        Transition(d, Event.REFUSE, State.REJECTED, reason=RejectReason.BUSINESS_REJECTED),
        Transition(e, Event.ABANDON, State.UNKNOWN, review="receipt_mismatch", looked=True,
                   evidence={"why": "mismatch"}),
        Transition(f, Event.FIND, State.SUCCEEDED, receipt={"reference": "r-6"}, looked=True),
    ]  # fmt: skip


def _written(rig: Rig, ids: list[int]) -> list[Any]:
    """What the writes left, read back alike on every database: no ids, and of clock values
    only whether they are set (and whether the next attempt is the far one)."""
    with rig.sessions() as s:
        rows = []
        for i in ids:
            op = s.get(Operation, i)
            assert op is not None
            rows.append(
                (
                    (op.state, op.reason, op.attempts, op.lookups, op.lease_owner,
                     op.lease_until is None, op.next_attempt_at > LATER - timedelta(hours=1),
                     op.first_sent_at is None, op.unknown_since is None, op.receipt,
                     op.downstream_ref, op.lease_version),
                    [
                        (e.from_state, e.to_state, e.actor, e.lease_version, e.reason, e.evidence)
                        for e in s.scalars(
                            select(OperationEvent)
                            .where(OperationEvent.operation_id == i)
                            .order_by(OperationEvent.id)
                        )
                    ],
                    [
                        (a.number, a.lease_version, a.worker, a.not_after is None,
                         a.finished_at is None, a.proof, a.status_code, a.detail)
                        for a in s.scalars(select(Attempt).where(Attempt.operation_id == i))
                    ],
                    [
                        (r.tenant, r.reason, r.evidence, r.version, r.resolved_at is None,
                         r.resolved_by, r.resolution)
                        for r in s.scalars(select(ReviewItem).where(ReviewItem.operation_id == i))
                    ],
                )
            )  # fmt: skip
        return rows


CREATED = (None, "planned", "intake", None, None, None)
STARTED = ("planned", "submitted", "w1", 1, None, {"attempt": 1})
ATTEMPT = (1, 1, "w1", False, False, "unknown", 504)
SUCCEEDED = ("succeeded", None, 1, 0, None, True, False, False, True)
#: What each shape of ``_outcomes`` leaves, then what a look (on c) and a lookup that found
#: the outcome (on e, whose review item it settles) leave.
EXPECTED = [
    (
        (*SUCCEEDED, {"reference": "r-1", "amount": 5}, "r-1", 1),
        [CREATED, STARTED, ("submitted", "succeeded", "w1", 1, None, None)],
        [(*ATTEMPT, None)],
        [],
    ),
    (
        ("planned", None, 1, 0, None, True, True, False, True, None, None, 1),
        [CREATED, STARTED, ("submitted", "planned", "w1", 1, None, {"status": 503})],
        [(*ATTEMPT, {"n": 1, "s": "é"})],
        [],
    ),
    (
        ("unknown", None, 1, 1, None, True, True, False, False, None, None, 2),
        [CREATED, STARTED, ("submitted", "unknown", "w1", 1, None, {"error": "ReadTimeout"}),
         ("unknown", "unknown", "r1", 2, "lookup_unavailable", {"lookup": "unavailable"})],
        [(*ATTEMPT, {"n": 2, "s": "é"})],
        [("acme", "lookup_unavailable", {"lookup": "unavailable"}, 1, True, None, None)],
    ),
    (
        ("rejected", "business_rejected", 1, 0, None, True, False, False, True, None, None, 1),
        [CREATED, STARTED, ("submitted", "rejected", "w1", 1, "business_rejected", None)],
        [(*ATTEMPT, {"n": 3, "s": "é"})],
        [],
    ),
    (
        (*SUCCEEDED[:3], 2, None, True, False, False, False, {"reference": "r-5"}, "r-5", 2),
        [CREATED, STARTED,
         ("submitted", "unknown", "w1", 1, "receipt_mismatch", {"why": "mismatch"}),
         ("unknown", "succeeded", "r1", 2, None, {"lookup": "found"})],
        [(*ATTEMPT, {"n": 4, "s": "é"})],
        [("acme", "receipt_mismatch", {"why": "mismatch"}, 2, False, "r1",
          {"state": "succeeded", "by": "r1", "settled_with_operation": True})],
    ),
    (
        (*SUCCEEDED[:3], 1, None, True, False, False, True, {"reference": "r-6"}, "r-6", 1),
        [CREATED, STARTED, ("submitted", "succeeded", "w1", 1, None, None)],
        [(*ATTEMPT, {"n": 5, "s": "é"})],
        [],
    ),
]  # fmt: skip


def test_every_shape_of_transition_writes_the_same_rows_on_each_database(rig: Rig) -> None:
    """Through the Storage interface, on each database (PostgreSQL: one statement per batch;
    SQLite: a few per transition): the same columns, JSON (null included), events with their
    lease versions, attempts, and review items opened and settled."""
    rig.judged_by_ledger = False  # storage-level: outcomes written by hand, nothing was sent
    ids = [rig.enqueue(f"x-{n}", {**GOOD, "amount_minor": 100 + n}) for n in range(6)]
    storage = rig.storage
    with rig.engine.connect() as conn:
        claims = claim_for_send(conn, worker="w1", lease_seconds=60, ids=ids)
        started = start_attempts(storage, conn, claims, worker="w1")
        outcomes = _outcomes(sorted(started, key=lambda c: c.id))
        finishes = [
            Finish(t.operation, "unknown", 504, {"n": n, "s": "é"} if n else None)
            for n, t in enumerate(outcomes)
            if isinstance(t.operation, Claimed)
        ]
        assert storage.write_transitions(conn, outcomes, actor="w1", finishes=finishes) == set(ids)
        conn.commit()
    with rig.sessions.begin() as s:
        unknown = Operation.id.in_([ids[2], ids[4]])
        s.execute(update(Operation).where(unknown).values(next_attempt_at=datetime.now(UTC)))
        looked_at = {c.id: c for c in claim_unresolved(s, worker="r1", lease_seconds=60, limit=5)}
    c, e = looked_at[ids[2]], looked_at[ids[4]]
    with rig.sessions.begin() as s:
        later = [
            Transition.look(c, note="lookup_unavailable", recheck_at=LATER, looked=True,
                            evidence={"lookup": "unavailable"}, review="lookup_unavailable"),
            Transition(e, Event.FIND, State.SUCCEEDED, receipt={"reference": "r-5"},
                       evidence={"lookup": "found"}, looked=True),
        ]  # fmt: skip
        assert storage.write_transitions(s, later, actor="r1") == {c.id, e.id}
    assert _written(rig, ids) == EXPECTED
