"""How a batch's outcomes are gathered into writes (``SendsBatches._send_and_record``), step by
step and without threads or real time: the sends' futures are completed by the test, during
the waits the batch makes, on a monotonic clock the test moves.

The first answer back is written with those that follow it, each within as long as the batch
has been out (at least ``record_linger``) of the one before; after that first write, a late
answer is written with any back within ``record_linger``, no longer. The ``after_send``
failpoint (a crash between a send and its record) is reached before the first write only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from outbox.observer import NO_OBSERVER
from outbox.states import State
from workers import sending
from workers.sending import SendsBatches

START = 1024.0  # the monotonic clock's reading when the batch goes out (times: in binary)


class Pool:
    """Stands for the thread pool: a send submitted is a future the test completes."""

    def __init__(self) -> None:
        self.sends: dict[int, tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = {}

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.sends[args[0]] = (fn, args, future)
        return future

    def back(self, *ops: int) -> None:
        for op in ops:
            fn, args, future = self.sends[op]
            future.set_result(fn(*args))

    def raised(self, op: int, error: Exception) -> None:
        self.sends[op][2].set_exception(error)


@dataclass
class Batches(SendsBatches):
    """A sender whose sends and writes are the test's: an operation is an int."""

    pool: Pool = field(default_factory=Pool)
    record_linger: float = 0.125
    max_batch: int = 8
    clock_margin: float = 1.0
    written: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.observer = NO_OBSERVER
        self._pool = self.pool  # type: ignore[assignment]
        self._making = threading.Lock()

    def _send_one(self, claimed: Any, kind: Any, clock: Any) -> Any:
        return SimpleNamespace(claimed=claimed)

    def _record(self, batch: list[Any]) -> dict[int, State]:
        self.written.append([sent.claimed for sent in batch])
        return {sent.claimed: State.SUCCEEDED for sent in batch}


class Script:
    """The batch's waits, in order: each is given what completes during it and what the
    monotonic clock reads after it; records the timeout each wait was given."""

    def __init__(self, pool: Pool, steps: Iterable[tuple[tuple[int, ...], float]]) -> None:
        self.pool = pool
        self.steps = list(steps)
        self.timeouts: list[float | None] = []
        self.now = START

    def monotonic(self) -> float:
        return self.now

    def wait(
        self, fs: Iterable[Future[Any]], timeout: float | None = None, return_when: str = ""
    ) -> tuple[set[Future[Any]], set[Future[Any]]]:
        assert self.steps, "a wait more than the script has"
        self.timeouts.append(timeout)
        ops, self.now = self.steps.pop(0)
        self.pool.back(*ops)
        pending = set(fs)
        done = {f for f in pending if f.done()}
        assert done or timeout is not None, "a wait without a timeout that nothing ends"
        return done, pending - done


@pytest.fixture
def failpoints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each failpoint reached, in order."""
    reached: list[str] = []
    monkeypatch.setattr(sending, "failpoint", reached.append)
    return reached


def scripted(
    monkeypatch: pytest.MonkeyPatch, batches: Batches, steps: list[tuple[tuple[int, ...], float]]
) -> Script:
    script = Script(batches.pool, steps)
    monkeypatch.setattr(sending, "wait", script.wait)
    monkeypatch.setattr(sending, "time", SimpleNamespace(monotonic=script.monotonic))
    return script


def send(batches: Batches, ops: list[int]) -> dict[int, State]:
    return batches._send_and_record([(op, None, None) for op in ops])  # type: ignore[misc]


def test_the_first_answers_are_gathered_for_as_long_as_the_batch_has_been_out(
    monkeypatch: pytest.MonkeyPatch, failpoints: list[str]
) -> None:
    """The first answer after 0.5 s: the batch waits up to 0.5 s for more (longer than the
    0.125 s linger), then, another back, up to the 0.75 s it has been out by then; the third
    comes back much later and is written on its own."""
    batches = Batches()
    script = scripted(
        monkeypatch,
        batches,
        [
            ((0,), START + 0.5),  # the first answer
            ((1,), START + 0.75),  # another within the 0.5 s
            ((), START + 1.5),  # none more within 0.75 s
            ((2,), START + 30.0),  # the slow one
        ],
    )
    written = send(batches, [0, 1, 2])
    assert not script.steps
    assert script.timeouts == [None, 0.5, 0.75, None]
    assert batches.written == [[0, 1], [2]]
    assert written == dict.fromkeys([0, 1, 2], State.SUCCEEDED)
    assert failpoints == ["after_send"]  # before the first write only


def test_after_the_first_write_late_answers_linger_only_record_linger(
    monkeypatch: pytest.MonkeyPatch, failpoints: list[str]
) -> None:
    """Once the first answers are written, a late one waits for others only ``record_linger``
    (0.125 s), however long the batch has been out; written in the batch's order."""
    batches = Batches()
    script = scripted(
        monkeypatch,
        batches,
        [
            ((0,), START + 0.25),
            ((), START + 0.5),  # none more within 0.25 s: written alone
            ((2,), START + 3.0),  # late
            ((1,), START + 3.0625),  # within 0.125 s of it
            ((), START + 3.1875),  # none more within 0.125 s
            ((3,), START + 9.0),
        ],
    )
    send(batches, [0, 1, 2, 3])
    assert not script.steps
    assert script.timeouts == [None, 0.25, None, 0.125, 0.125, None]
    assert batches.written == [[0], [1, 2], [3]]
    assert failpoints == ["after_send"]


def test_a_send_that_raised_is_not_the_first_write_and_its_error_is_raised_after(
    monkeypatch: pytest.MonkeyPatch, failpoints: list[str]
) -> None:
    """The first to come back raised (a bug in an adapter): nothing is written for it, so the
    next answer is still the first write (gathered for as long as the batch has been out, the
    failpoint before it); the error is raised once the others are written."""
    batches = Batches()
    error = RuntimeError("the adapter failed")
    script = scripted(
        monkeypatch,
        batches,
        [
            ((), START + 0.25),  # op 0 raised (as it was submitted, below)
            ((), START + 0.5),  # none more within 0.25 s
            ((1,), START + 0.75),  # the first answer
            ((), START + 1.5),  # none more within 0.75 s
            ((2,), START + 5.0),
        ],
    )
    submit = batches.pool.submit

    def submitted(fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future = submit(fn, *args)
        if args[0] == 0:
            batches.pool.raised(0, error)
        return future

    monkeypatch.setattr(batches.pool, "submit", submitted)
    with pytest.raises(RuntimeError, match="the adapter failed"):
        send(batches, [0, 1, 2])
    assert not script.steps
    assert script.timeouts == [None, 0.25, None, 0.75, None]
    assert batches.written == [[1], [2]]
    assert failpoints == ["after_send"]


def test_nothing_to_send_writes_nothing_and_reaches_no_failpoint(
    monkeypatch: pytest.MonkeyPatch, failpoints: list[str]
) -> None:
    batches = Batches()
    scripted(monkeypatch, batches, [])  # and waits for nothing
    assert send(batches, []) == {}
    assert batches.written == [] and batches.pool.sends == {}
    assert failpoints == []


def test_a_lone_send_is_sent_by_the_caller_and_written_with_the_failpoint_before_it(
    monkeypatch: pytest.MonkeyPatch, failpoints: list[str]
) -> None:
    batches = Batches()
    scripted(monkeypatch, batches, [])  # no thread of the pool, no wait for it
    assert send(batches, [7]) == {7: State.SUCCEEDED}
    assert batches.written == [[7]] and batches.pool.sends == {}
    assert failpoints == ["after_send"]
