"""Hints of concurrent tasks worked in shared batches (``workers.coalesce``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from outbox.outage import DatabaseOutage
from outbox.states import State
from tests.support.services import wait_until
from workers.coalesce import Coalescer


class Downstream:
    """An ``execute`` that records its batches; the first one waits until released."""

    def __init__(self, *, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.first_started = threading.Event()
        self.release = threading.Event()
        self.fail_on = fail_on

    def execute(self, ids: Sequence[int]) -> dict[int, State]:
        self.batches.append(list(ids))
        if len(self.batches) == 1:
            self.first_started.set()
            assert self.release.wait(10)
        if self.fail_on is not None and self.fail_on in ids:
            raise RuntimeError("the database is away")
        return {i: State.SUCCEEDED for i in ids if i % 2 == 0}  # odd ids: claimed elsewhere


def test_an_idle_coalescer_works_a_hint_at_once_and_returns_its_states() -> None:
    down = Downstream()
    down.release.set()
    coalescer = Coalescer(down.execute, runners=1)
    assert coalescer.execute([2, 3]) == {2: State.SUCCEEDED}
    assert down.batches == [[2, 3]]
    coalescer.close()


def test_hints_that_arrive_while_a_batch_runs_are_worked_together() -> None:
    down = Downstream()
    coalescer = Coalescer(down.execute, runners=1, max_batch=32)
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(coalescer.execute, [2])
        assert down.first_started.wait(10)
        later = {i: pool.submit(coalescer.execute, [i, i + 1]) for i in (10, 20, 30, 40, 50)}
        assert wait_until(lambda: coalescer._queue.qsize() == 5, 10)
        down.release.set()
        assert first.result(10) == {2: State.SUCCEEDED}
        for i, future in later.items():
            assert future.result(10) == {i: State.SUCCEEDED}  # its own ids only
    assert down.batches[0] == [2]
    assert sorted(down.batches[1]) == [10, 11, 20, 21, 30, 31, 40, 41, 50, 51]
    assert len(down.batches) == 2
    coalescer.close()


def test_a_batch_takes_no_more_than_max_batch_ids_beyond_its_first_hint() -> None:
    down = Downstream()
    coalescer = Coalescer(down.execute, runners=1, max_batch=4)
    with ThreadPoolExecutor(6) as pool:
        futures: list[Future[dict[int, State]]] = [pool.submit(coalescer.execute, [0])]
        assert down.first_started.wait(10)
        futures += [pool.submit(coalescer.execute, [i, i + 1]) for i in (10, 20, 30, 40)]
        assert wait_until(lambda: coalescer._queue.qsize() == 4, 10)
        down.release.set()
        for future in futures:
            future.result(10)
    assert [len(b) for b in down.batches] == [1, 4, 4]
    coalescer.close()


def test_a_failed_batch_fails_each_of_its_hints_and_the_next_batch_still_runs() -> None:
    down = Downstream(fail_on=7)
    coalescer = Coalescer(down.execute, runners=1)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(coalescer.execute, [2])
        assert down.first_started.wait(10)
        failing = [pool.submit(coalescer.execute, [7]), pool.submit(coalescer.execute, [8])]
        assert wait_until(lambda: coalescer._queue.qsize() == 2, 10)
        down.release.set()
        assert first.result(10) == {2: State.SUCCEEDED}
        for future in failing:  # one batch: both get its exception
            with pytest.raises(RuntimeError, match="database is away"):
                future.result(10)
    assert coalescer.execute([4]) == {4: State.SUCCEEDED}
    coalescer.close()


def test_closed_runners_end_and_a_later_hint_starts_new_ones() -> None:
    down = Downstream()
    down.release.set()
    coalescer = Coalescer(down.execute, runners=2)
    assert coalescer.execute([2]) == {2: State.SUCCEEDED}
    threads = list(coalescer._threads)
    coalescer.close()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert coalescer.execute([4]) == {4: State.SUCCEEDED}
    coalescer.close()


@pytest.mark.parametrize(("runners", "max_batch"), [(0, 1), (1, 0)])
def test_a_coalescer_needs_a_runner_and_room_for_an_id(runners: int, max_batch: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Coalescer(lambda ids: {}, runners=runners, max_batch=max_batch)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def execute(self, ids: Sequence[int]) -> dict[int, State]:
        self.calls.append(list(ids))
        return {}


class _Runtime:
    def __init__(self) -> None:
        self.executor = _Recorder()
        self.batched = _Recorder()
        self.outage = DatabaseOutage()

    def coalescer(self) -> _Recorder:
        return self.batched


@pytest.mark.parametrize("coalesce", [False, True])
def test_the_submit_task_hands_hints_to_the_coalescer_only_on_the_thread_pool(
    coalesce: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.settings import Settings
    from settled import celery_app

    rt = _Runtime()
    monkeypatch.setattr(celery_app, "runtime", lambda settings: rt)
    app = celery_app.create_app(Settings(), coalesce=coalesce)
    app.tasks[celery_app.SUBMIT].run([5, 6])
    assert (rt.batched.calls, rt.executor.calls) == (([[5, 6]], []) if coalesce else ([], [[5, 6]]))


def test_tasks_starting_at_once_in_threads_build_one_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread pool's first tasks start together: one runtime (one engine, one executor,
    one coalescer) for the process, not one each."""
    from outbox.settings import Settings
    from settled import celery_app

    builds: list[object] = []
    second = threading.Event()

    def build(settings: Settings) -> object:
        builds.append(settings)
        if len(builds) > 1:
            second.set()
        second.wait(0.5)  # a second build would start meanwhile, were it not refused
        return _Runtime()

    monkeypatch.setattr(celery_app, "_runtimes", (os.getpid(), {}))
    monkeypatch.setattr(celery_app, "build_runtime", build)
    start = threading.Barrier(8)

    def first_task() -> object:
        start.wait(10)
        return celery_app.runtime(Settings())

    with ThreadPoolExecutor(8) as pool:
        runtimes = list(pool.map(lambda _: first_task(), range(8)))
    assert len(builds) == 1
    assert all(rt is runtimes[0] for rt in runtimes)
