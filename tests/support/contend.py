"""Two transactions racing, with explicit pauses instead of sleeps.

The interleaving SQLite gets wrong: transaction A reads, another connection B commits, A
writes. A deferred transaction cannot take the write lock once its snapshot is stale
(SQLITE_BUSY_SNAPSHOT, "database is locked" at once, whatever the busy timeout). To put B
between A's read and A's write, A pauses there (``pausing``) and starts B (a ``Contender``,
in a thread of its own); A goes on once B has *started*: B ran a statement of its
transaction (it holds a snapshot, or a write), or B asks for SQLite's write lock
(``BEGIN IMMEDIATE``, where it waits while A holds the lock). Either way the race is on, and
whatever the code under test does from there must give the documented answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, Generic, TypeVar

import pytest
from sqlalchemy import Engine, event

T = TypeVar("T")

#: How long either side waits for the other before the test fails (a loaded machine).
DEADLINE = 30.0


class Contender(Generic[T]):
    """``work`` run in a thread of its own; ``started`` is set once its transaction is under
    way (see the module docstring)."""

    def __init__(self, work: Callable[[], T]) -> None:
        self.work = work
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._result: T | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def result(self) -> T:
        """What ``work`` returned (its exception raised here), once it has finished."""
        self._thread.join(DEADLINE)
        assert not self._thread.is_alive(), "the contender did not finish"
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def _run(self) -> None:
        try:
            self._result = self.work()
        except BaseException as exc:  # handed to ``result``
            self._error = exc
        finally:
            self.started.set()  # finished counts as started

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def _before(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if self._mine() and statement.lstrip().upper().startswith("BEGIN IMMEDIATE"):
            self.started.set()  # it may wait here for A's lock: A must go on

    def _after(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if self._mine() and statement.strip().upper() not in {"BEGIN", "BEGIN DEFERRED"}:
            self.started.set()  # a deferred BEGIN takes no snapshot yet; a statement does


@contextmanager
def contender(work: Callable[[], T]) -> Iterator[Contender[T]]:
    """A ``Contender`` whose statements are watched on every engine while the block runs."""
    racer = Contender(work)
    event.listen(Engine, "before_cursor_execute", racer._before)
    event.listen(Engine, "after_cursor_execute", racer._after)
    try:
        yield racer
    finally:
        event.remove(Engine, "before_cursor_execute", racer._before)
        event.remove(Engine, "after_cursor_execute", racer._after)


def pausing(
    monkeypatch: pytest.MonkeyPatch,
    target: object,
    name: str,
    racer: Contender[Any],
    *,
    after: bool = False,
) -> None:
    """Replace ``target.name`` so that its first call starts ``racer`` and waits until it has
    started: before the call, or ``after`` it. Later calls (the racer's own) run as they are."""
    original = getattr(target, name)
    first = threading.Lock()

    def wait_for_racer() -> None:
        racer.start()
        assert racer.started.wait(DEADLINE), "the contender never started"

    @wraps(original)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not first.acquire(blocking=False):
            return original(*args, **kwargs)
        if not after:
            wait_for_racer()
        got = original(*args, **kwargs)
        if after:
            wait_for_racer()
        return got

    monkeypatch.setattr(target, name, paused)
