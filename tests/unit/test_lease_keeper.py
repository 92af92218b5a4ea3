"""The lease keeper's own rules (``outbox.leases.LeaseKeeper``), with its database and its
thread's wait in the test's hands: the cadence of its rounds, its thread's start and stop, and
its bookkeeping of what it holds. What the database renews is tests/integration/test_leases.py.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy.exc import OperationalError, SQLAlchemyError

import outbox.leases
from outbox.leases import LeaseKeeper
from outbox.outage import DatabaseOutage
from outbox.states import State
from outbox.storage.claims import Claimed

T0 = datetime(2026, 1, 1, tzinfo=UTC)
#: far longer than any wait these tests make: reached only when the code under test is wrong
BOUND = 10.0


def claimed(op: int, version: int = 1) -> Claimed:
    return Claimed(
        id=op,
        tenant="t",
        op_id=f"op-{op}",
        kind="refund",
        params={},
        fingerprint="f",
        fingerprint_key_version="v1",
        idempotency_key=f"k-{op}",
        state=State.PLANNED,
        attempts=0,
        max_attempts=3,
        deadline=T0 + timedelta(hours=1),
        first_sent_at=None,
        run_id=None,
        lease_version=version,
        lease_until=T0 + timedelta(seconds=30),
        now=T0,
    )


class Database:
    """The keeper's database: counts its transactions and answers its renewals as told.

    ``refuse``: the ids it will not renew (lapsed, or taken over); ``error``: the renewal
    fails; ``during``: called inside each renewal (the holder doing something meanwhile)."""

    def __init__(self) -> None:
        self.transactions = 0
        self.renewals: list[list[tuple[int, int]]] = []
        self.refuse: set[int] = set()
        self.error: SQLAlchemyError | None = None
        self.during: Callable[[], None] | None = None
        self.end = T0 + timedelta(minutes=10)

    @contextmanager
    def begin(self) -> Iterator[object]:
        self.transactions += 1
        yield object()

    def renew(
        self, session: object, held: Sequence[tuple[int, int]], *, owner: str, lease_seconds: float
    ) -> dict[int, datetime]:
        self.renewals.append(list(held))
        if self.during is not None:
            self.during()
        if self.error is not None:
            raise self.error
        return {i: self.end for i, _ in held if i not in self.refuse}


class SteppedWait:
    """The keeper thread's wait between rounds, stepped by the test: each wait records how
    long it was asked to wait and tells the test; ``tick`` ends it as the time running out
    does (one round follows), ``until_stopped`` lets it wait for the keeper's stop as the real
    wait does."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._steps: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[threading.Thread] = queue.SimpleQueue()

    def __call__(self, stop: threading.Event, seconds: float) -> bool:
        self.seconds.append(seconds)
        self._waits.put(threading.current_thread())
        if self._steps.get(timeout=BOUND):
            return False
        return stop.wait(BOUND)

    def waiting(self) -> threading.Thread:
        """The next wait has begun; the thread waiting."""
        return self._waits.get(timeout=BOUND)

    def tick(self) -> None:
        self._steps.put(True)

    def until_stopped(self) -> None:
        self._steps.put(False)


@pytest.fixture
def db(monkeypatch: pytest.MonkeyPatch) -> Database:
    database = Database()
    monkeypatch.setattr(outbox.leases, "renew_leases", database.renew)
    return database


def no_rounds(stop: threading.Event, seconds: float) -> bool:
    """A wait whose time never runs out: the test makes each round itself (``renew_now``)."""
    return stop.wait()


Keepers = Callable[..., LeaseKeeper]


@pytest.fixture
def keeper(db: Database) -> Iterator[Keepers]:
    """Makes keepers over ``db`` (waiting with ``no_rounds`` unless told), closed after."""
    made: list[LeaseKeeper] = []

    def make(wait: Any = no_rounds, **kw: Any) -> LeaseKeeper:
        k = LeaseKeeper(
            cast(Any, db), owner="w1", lease_seconds=kw.pop("lease", 30.0), wait=wait, **kw
        )
        made.append(k)
        return k

    yield make
    for k in made:
        if isinstance(k._wait, SteppedWait):
            k._wait.until_stopped()  # a test that failed midway leaves no thread waiting
        k.close()


def thread_of(k: LeaseKeeper) -> threading.Thread | None:
    return k._thread


# -- the cadence ---------------------------------------------------------------------------


def test_the_thread_renews_every_third_of_a_lease(db: Database, keeper: Keepers) -> None:
    """Three chances to renew before a lease runs out: the thread waits a third of a lease,
    renews, and waits a third again."""
    wait = SteppedWait()
    k = keeper(wait, lease=12.0)
    with k.holding([claimed(1)]):
        wait.waiting()
        assert wait.seconds == [4.0] and db.renewals == []
        wait.tick()
        wait.waiting()
        assert wait.seconds == [4.0, 4.0] and db.renewals == [[(1, 1)]]
        wait.tick()
        wait.waiting()
        assert db.renewals == [[(1, 1)], [(1, 1)]]


# -- the thread's start and stop -------------------------------------------------------------


def test_nothing_held_starts_no_thread_and_touches_no_database(
    db: Database, keeper: Keepers
) -> None:
    k = keeper()
    with k.holding([]):
        assert thread_of(k) is None
    assert k.renew_now() == set()
    assert db.transactions == 0  # an idle keeper opens no transaction, round after round
    k.close()  # a keeper that never started closes
    k.close()
    assert thread_of(k) is None


def test_one_thread_renews_everything_held(db: Database, keeper: Keepers) -> None:
    wait = SteppedWait()
    k = keeper(wait)
    with k.holding([claimed(1)]):
        first = wait.waiting()
        assert thread_of(k) is first and first.daemon  # never keeps the process alive
        with k.holding([claimed(2)]):
            assert thread_of(k) is first
            wait.tick()
            assert wait.waiting() is first
            assert db.renewals == [[(1, 1), (2, 1)]]
    wait.until_stopped()
    k.close()
    assert not first.is_alive()


def test_close_waits_for_the_round_under_way_and_is_idempotent(
    db: Database, keeper: Keepers
) -> None:
    """After ``close`` no renewal is in flight: a worker shutting down may dispose of its
    engine. The round is held in the database until the stop is set."""
    wait = SteppedWait()
    k = keeper(wait)
    finished: list[bool] = []
    with k.holding([claimed(1)]):
        thread = wait.waiting()
        db.during = lambda: finished.append(k._stop.wait(BOUND))
        wait.tick()
        wait.until_stopped()
        k.close()
        assert not thread.is_alive()
        assert finished == [True]  # the round ended before close returned
        k.close()


def test_close_waits_at_most_five_seconds_for_a_stuck_round(
    db: Database, keeper: Keepers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal stuck in the database does not hold a worker's shutdown forever: ``close``
    waits for it 5 s at most (the test's join records that and then unsticks it)."""
    wait = SteppedWait()
    k = keeper(wait)
    in_database, unstuck = threading.Event(), threading.Event()

    def stuck() -> None:
        in_database.set()
        unstuck.wait(BOUND)

    joins: list[float | None] = []
    with k.holding([claimed(1)]):
        thread = wait.waiting()
        db.during = stuck
        wait.tick()
        assert in_database.wait(BOUND)
        real_join = thread.join

        def join(timeout: float | None = None) -> None:
            joins.append(timeout)
            unstuck.set()
            wait.until_stopped()
            real_join(BOUND)

        monkeypatch.setattr(thread, "join", join)
        k.close()
    assert joins == [5]
    assert not thread.is_alive()


def test_a_keeper_closed_from_its_own_thread_stops_without_error(
    db: Database, keeper: Keepers
) -> None:
    errors: list[BaseException] = []
    rounds: list[int] = []

    def wait(stop: threading.Event, seconds: float) -> bool:
        rounds.append(1)
        if len(rounds) == 1:
            return False  # one round, in which the keeper is closed
        return stop.wait(BOUND)

    k = keeper(wait)

    def close_here() -> None:
        try:
            k.close()
        except BaseException as exc:  # what the test reports
            errors.append(exc)

    db.during = close_here
    with k.holding([claimed(1)]):
        thread = thread_of(k)
        assert thread is not None
        thread.join(BOUND)
    assert not thread.is_alive()
    assert errors == [] and rounds == [1, 1]


def test_a_keeper_holding_again_after_close_starts_a_new_thread(
    db: Database, keeper: Keepers
) -> None:
    wait = SteppedWait()
    k = keeper(wait)
    with k.holding([claimed(1)]):
        first = wait.waiting()
        wait.until_stopped()
        k.close()
    assert not first.is_alive()
    with k.holding([claimed(2)]):
        second = wait.waiting()
        assert second is not first and second.is_alive()
        wait.tick()
        assert wait.waiting() is second
        assert db.renewals == [[(2, 1)]]  # renewing again, what is held now
    wait.until_stopped()
    k.close()
    assert not second.is_alive()


def test_a_keeper_whose_thread_could_not_start_still_closes(
    db: Database, keeper: Keepers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process out of threads: the holding fails, and the shutdown after it does not."""

    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    k = keeper()
    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError, match="can't start"), k.holding([claimed(1)]):
        pass
    k.close()


# -- the bookkeeping ------------------------------------------------------------------------


def test_a_claim_released_during_its_renewal_keeps_nothing(db: Database, keeper: Keepers) -> None:
    """The holder finished while the database renewed its lease: neither the renewal nor a
    refusal is kept for it, and nothing of it is held."""
    k = keeper()
    c = claimed(1)
    for refused in (set(), {1}):
        db.refuse = refused
        holding = k.holding([c])
        holding.__enter__()
        db.during = lambda h=holding: h.__exit__(None, None, None)  # type: ignore[misc]
        renewed = k.renew_now()
        assert renewed == ({1} - refused)  # what the database said
        assert k.held() == set()
        assert k.lease_until(c) == c.lease_until


def test_a_lease_not_renewed_is_dropped_and_logged(
    db: Database, keeper: Keepers, caplog: pytest.LogCaptureFixture
) -> None:
    k = keeper()
    db.refuse = {2}
    with caplog.at_level(logging.INFO, logger="outbox.leases"), k.holding([claimed(1), claimed(2)]):
        assert k.renew_now() == {1}
        assert k.held() == {1}
        assert k.lease_until(claimed(2)) is None
    lost = [r for r in caplog.records if r.getMessage() == "lease not renewed"]
    assert [r.operations for r in lost] == [1]  # type: ignore[attr-defined]


def test_a_database_error_renews_nothing_and_keeps_what_is_held(
    db: Database, keeper: Keepers
) -> None:
    """The next round tries again: nothing is dropped for a database that did not answer."""
    k = keeper()
    c = claimed(1)
    with k.holding([c]):
        db.error = OperationalError("renew", {}, Exception("gone"))
        assert k.renew_now() == set()
        assert k.held() == {1} and k.lease_until(c) == c.lease_until
        db.error = None
        assert k.renew_now() == {1}
        assert k.lease_until(c) == db.end


def test_renewals_failing_while_the_database_is_away_are_said_once_for_the_process(
    db: Database, keeper: Keepers, caplog: pytest.LogCaptureFixture
) -> None:
    """With the process's outage view (``outbox.outage``), a round after round the database
    does not answer is one line for the outage, not a warning each round; a keeper without
    one warns each round, as before."""
    outage = DatabaseOutage()
    k = keeper(outage=outage)
    db.error = OperationalError("renew", {}, Exception("gone"))
    with caplog.at_level(logging.INFO), k.holding([claimed(1)]):
        for _ in range(3):
            assert k.renew_now() == set()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["database unreachable; retrying"]
    caplog.clear()
    alone = keeper()
    with caplog.at_level(logging.INFO), alone.holding([claimed(2)]):
        alone.renew_now()
    assert [r.getMessage() for r in caplog.records] == ["could not renew leases"]
