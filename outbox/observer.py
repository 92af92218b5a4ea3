"""Observer hooks: what the services tell whoever watches them (logs, traces, your own).

The intake (``Outbox``), the relay, the executor and the reconciler each take an ``observer``
when they are built (default ``NO_OBSERVER``, which does nothing); Settled's runtime passes
``settled.observe.Observed`` (an operation's identity in log lines, OpenTelemetry spans while
tracing is on). Each hook is a context manager around one step, and yields a function the
service calls with what the step did, once, if the step got that far:

==============  ======================================  ==========================================
hook            around                                  reported
==============  ======================================  ==========================================
``enqueuing``   ``Outbox.enqueue``                      its ``Enqueued`` (id, op_id, created...)
``hinting``     publishing the hints of these ids       (nothing)
``claiming``    the executor's claim of a batch         the ``ClaimedBatch``
``sending``     one attempt: an operation's send        its ``SubmitOutcome``
``recording``   writing a batch's outcomes              the states written, by operation id
``recovering``  a dead worker's send, looked up         the state written (None: nothing written)
``reconciling`` the reconciler's lookup and decision    its outcome code (``found``, ``stale``...)
==============  ======================================  ==========================================

``sending`` runs in the thread that sends (a thread per send of a batch), the others in the
service's own. A hook raises nothing into the service: the services call their observer
through ``guarded``, which logs an observer's error and goes on as if it had not been there
(a failing observer never changes an outcome, nor hides the step's own error).

Subclass ``NoObserver`` and override the hooks you want (Dramatiq's middleware and Temporal's
interceptors are the models).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from outbox.downstream import SubmitOutcome
    from outbox.states import State
    from outbox.storage.claims import Claimed

log = logging.getLogger(__name__)

R = TypeVar("R")


class Intake(Protocol):
    """What ``enqueuing`` is told: what intake did (``outbox.intake.Enqueued``)."""

    @property
    def id(self) -> int | None:
        """The operation's primary key (None: a replay of a pruned one, ``Enqueued.pruned``)."""

    @property
    def op_id(self) -> str:
        """The operation's op_id."""

    @property
    def created(self) -> bool:
        """Whether this call created it (False: a replay)."""


#: What a hook yields: called with what the step did.
Report = Callable[[R], None]
#: A hook: a context manager around one step.
Around = AbstractContextManager[Report[R]]


@dataclass(frozen=True)
class ClaimedBatch:
    """What one claim of the executor took: the operations hinted, those claimed, and which
    of them are sent and which only looked up (a dead worker's)."""

    hinted: Sequence[int]
    claimed: Sequence[Claimed]
    to_send: Sequence[Claimed]
    to_recover: Sequence[Claimed]


class Observer(Protocol):
    """The hooks (module docstring)."""

    def enqueuing(
        self, session: Session, *, tenant: object, op_id: object, kind: object
    ) -> Around[Intake]: ...

    def hinting(self, ids: Sequence[int]) -> Around[None]: ...

    def claiming(self, hinted: Sequence[int]) -> Around[ClaimedBatch]: ...

    def sending(self, claimed: Claimed) -> Around[SubmitOutcome]: ...

    def recording(
        self, outcomes: Sequence[tuple[Claimed, SubmitOutcome]]
    ) -> Around[Mapping[int, State]]: ...

    def recovering(self, claimed: Claimed) -> Around[State | None]: ...

    def reconciling(self, claimed: Claimed) -> Around[str]: ...


def _ignore(_: object) -> None:
    return None


@contextmanager
def _nothing() -> Iterator[Report[Any]]:
    yield _ignore


class NoObserver:
    """An observer that does nothing: the default, and a base to override hooks of."""

    def enqueuing(
        self, session: Session, *, tenant: object, op_id: object, kind: object
    ) -> Around[Intake]:
        return _nothing()

    def hinting(self, ids: Sequence[int]) -> Around[None]:
        return _nothing()

    def claiming(self, hinted: Sequence[int]) -> Around[ClaimedBatch]:
        return _nothing()

    def sending(self, claimed: Claimed) -> Around[SubmitOutcome]:
        return _nothing()

    def recording(
        self, outcomes: Sequence[tuple[Claimed, SubmitOutcome]]
    ) -> Around[Mapping[int, State]]:
        return _nothing()

    def recovering(self, claimed: Claimed) -> Around[State | None]:
        return _nothing()

    def reconciling(self, claimed: Claimed) -> Around[str]:
        return _nothing()


NO_OBSERVER: Observer = NoObserver()


def _failed(hook: str) -> None:
    log.exception("an observer failed in %s; the step goes on without it", hook)


class _Guard(Generic[R]):
    """One hook of an observer, whose errors are logged and go no further."""

    def __init__(self, hook: str, make: Callable[[], Around[R]]) -> None:
        self.hook = hook
        self.make = make
        self.inner: Around[R] | None = None

    def __enter__(self) -> Report[R]:
        try:
            inner = self.make()
            report = inner.__enter__()
        except Exception:
            _failed(self.hook)
            return _ignore
        self.inner = inner

        def guarded_report(value: R) -> None:
            try:
                report(value)
            except Exception:
                _failed(self.hook)

        return guarded_report

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        inner, self.inner = self.inner, None
        if inner is not None:
            try:
                inner.__exit__(kind, error, tb)  # what it returns is ignored: nothing is hidden
            except Exception as raised:
                if raised is not error:
                    _failed(self.hook)
        return False  # the step's own error, if any, goes on


class Guarded:
    """``observer``, every hook guarded: its errors are logged, never raised."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def enqueuing(
        self, session: Session, *, tenant: object, op_id: object, kind: object
    ) -> Around[Intake]:
        o = self.observer
        return _Guard(
            "enqueuing", lambda: o.enqueuing(session, tenant=tenant, op_id=op_id, kind=kind)
        )

    def hinting(self, ids: Sequence[int]) -> Around[None]:
        return _Guard("hinting", lambda: self.observer.hinting(ids))

    def claiming(self, hinted: Sequence[int]) -> Around[ClaimedBatch]:
        return _Guard("claiming", lambda: self.observer.claiming(hinted))

    def sending(self, claimed: Claimed) -> Around[SubmitOutcome]:
        return _Guard("sending", lambda: self.observer.sending(claimed))

    def recording(
        self, outcomes: Sequence[tuple[Claimed, SubmitOutcome]]
    ) -> Around[Mapping[int, State]]:
        return _Guard("recording", lambda: self.observer.recording(outcomes))

    def recovering(self, claimed: Claimed) -> Around[State | None]:
        return _Guard("recovering", lambda: self.observer.recovering(claimed))

    def reconciling(self, claimed: Claimed) -> Around[str]:
        return _Guard("reconciling", lambda: self.observer.reconciling(claimed))


def guarded(observer: Observer) -> Observer:
    """``observer`` with every hook guarded (itself if it is guarded already, or does
    nothing)."""
    if type(observer) in (Guarded, NoObserver):
        return observer
    return Guarded(observer)
