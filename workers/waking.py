"""The executor's wake: when a send proves a downstream is back, the operations waiting on
backoff after refusals from it are made due now, a bounded batch at a time (half-open).

An outage of refused connections pushes every waiting operation's ``next_attempt_at`` out by
exponential backoff, towards the contract's ``retry_cap`` (minutes): without a wake, the last
of them goes out long after the service is back. The first send that comes back accepted or
refused (``workers.downstreams.proves_back``) wakes up to ``max_batch`` of them
(``outbox.storage.waking.wake_waiting``: oldest wait first, never while a ``Retry-After`` of
that downstream holds); the sweeper hints them within its period, a worker's due claims take
them, and their own successes wake the next batch. A downstream that is not back yet refuses
the woken few and they back off again: no stampede beyond one worker batch per answer.

A process only tries a wake for a downstream it has reason to think operations wait for
(``_suspect``): it recorded a not-sent / not-executed outcome from it, or sent an operation
tried before (a woken one). So a healthy downstream's sends cost no statement more; what
another process left waiting is found by the recovery probe on beat
(``workers.recovery_probe``). One log line per wake (``woken: the downstream is back``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import Connection

from outbox.downstream import NotExecuted, NotSent, SubmitOutcome
from outbox.kinds import Kind, KindRegistry
from outbox.storage import Storage
from outbox.storage.claims import Claimed
from outbox.storage.waking import wake_waiting
from workers.downstreams import Downstreams, proves_back

log = logging.getLogger("workers.executor")

T = TypeVar("T")


def wake(
    storage: Storage, downstream: str, kinds: Sequence[str], limit: int, *, by: str
) -> list[int]:
    """Wake up to ``limit`` operations of ``kinds`` (``downstream``'s) waiting after refusals;
    the ids woken, logged once when there are any (``by``: what proved the downstream back)."""
    woken = storage.step(lambda conn: wake_waiting(conn, kinds=kinds, limit=limit))
    if woken:
        log.info(
            "woken: the downstream is back",
            extra={"downstream": downstream, "woken": len(woken), "limit": limit, "by": by},
        )
    return woken


class WakesWaiting:
    """The executor's wake (a part of ``Executor``, which has what it uses)."""

    registry: KindRegistry
    downstreams: Downstreams
    max_batch: int
    _suspect: set[str]
    _suspect_lock: threading.Lock

    @property
    def storage(self) -> Storage:
        raise NotImplementedError

    def _step(self, work: Callable[[Connection], T]) -> T:
        raise NotImplementedError

    def _wake_after(self, sent: Sequence[tuple[Claimed, Kind, SubmitOutcome]]) -> list[int]:
        """After a batch's outcomes are written: wake what waits for each downstream that
        answered (``max_batch`` at most each); the ids woken. A failed wake is logged only:
        the backoff still brings those operations back."""
        back: set[str] = set()
        with self._suspect_lock:
            for claimed, kind, outcome in sent:
                downstream = self.downstreams.of(kind.name)
                # attempts counts this one: more than one, it waited before (perhaps woken)
                if isinstance(outcome, NotSent | NotExecuted) or claimed.attempts > 1:
                    self._suspect.add(downstream)
                if proves_back(outcome):
                    back.add(downstream)
            back &= self._suspect
        woken: list[int] = []
        for downstream in sorted(back):
            kinds = self.downstreams.kinds_of(downstream, self.registry.names())
            limit = max(1, self.max_batch)
            try:
                some = wake(self.storage, downstream, kinds, limit, by="send")
            except Exception:
                log.exception("waking failed; the backoff brings them back")
                continue
            if len(some) < limit:  # nothing more waits (or a Retry-After holds them)
                with self._suspect_lock:
                    self._suspect.discard(downstream)
            woken += some
        return woken
