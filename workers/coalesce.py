"""Hints that arrive together, worked together: one batch for the hints of concurrent tasks.

Under Celery's thread pool one worker process runs several submit tasks at once. Alone, each
would claim, send and record its hinted operation by itself: a claim transaction and an outcome
statement per operation, however many arrive at once. A ``Coalescer`` gives every task's ids to
a few runner threads; a free runner takes everything that is waiting (up to ``max_batch`` ids)
as one batch, the natural batching of a group commit. Nothing waits for a batch to fill: an idle
process works each hint at once, and batches grow only while runners are busy.

A task returns when the batch holding its operations is done (its exception, if the batch
failed), so a hint is still acknowledged (``acks_late``) only after its operations were worked.
What a batch does is the executor's, unchanged: each operation is claimed, fenced and written
under its own lease version.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from outbox.states import State

log = logging.getLogger(__name__)

Execute = Callable[[Sequence[int]], dict[int, State]]


class _Request:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.future: Future[dict[int, State]] = Future()


class Coalescer:
    """Works the ids of concurrent callers in shared batches, ``runners`` batches at a time."""

    def __init__(self, execute: Execute, *, runners: int = 2, max_batch: int = 32) -> None:
        if runners < 1 or max_batch < 1:
            raise ValueError("runners and max_batch must be at least 1")
        self._execute = execute
        self.runners = runners
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pid = 0

    def execute(self, ids: Sequence[int]) -> dict[int, State]:
        """Work ``ids`` (in a batch with whatever else is waiting); the states written for
        them, or the exception of their batch."""
        request = _Request(list(ids))
        self._start()
        self._queue.put(request)
        return request.future.result()

    def close(self) -> None:
        """Let the runners end once what is queued is done."""
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            self._threads = []

    def _start(self) -> None:
        """Start the runners once per process (a forked child starts its own)."""
        with self._lock:
            if self._pid == os.getpid() and self._threads:
                return
            self._pid = os.getpid()
            self._queue = queue.SimpleQueue()  # a fork copies no thread to serve the old one
            self._threads = [
                threading.Thread(target=self._run, name=f"settled-batch-{n}", daemon=True)
                for n in range(self.runners)
            ]
            for thread in self._threads:
                thread.start()

    def _take(self, first: _Request) -> tuple[list[_Request], bool]:
        """``first`` and whatever else waits, up to ``max_batch`` ids; True if told to stop."""
        batch, size = [first], len(first.ids)
        while size < self.max_batch:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return batch, True
            batch.append(more)
            size += len(more.ids)
        return batch, False

    def _run(self) -> None:
        queued = self._queue
        while True:
            first = queued.get()
            if first is None:
                return
            batch, stop = self._take(first)
            self._work(batch)
            if stop:
                return

    def _work(self, batch: list[_Request]) -> None:
        ids = list(dict.fromkeys(i for request in batch for i in request.ids))
        if len(batch) > 1:
            log.info("hints worked together", extra={"hints": len(batch), "operations": len(ids)})
        try:
            written = self._execute(ids)
        except BaseException as exc:  # every caller of the batch gets it, as it would alone;
            for request in batch:  # the runner lives on for the next batch
                request.future.set_exception(exc)
            return
        for request in batch:
            request.future.set_result({i: written[i] for i in request.ids if i in written})
