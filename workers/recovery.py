"""Recovery: an operation found ``submitted`` with an expired lease may have been sent (its
worker died before recording): it is only looked up, never sent again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection

from outbox.clock import DbClock
from outbox.downstream import Gateway, look_up, lookup_deadline
from outbox.errors import SettledError
from outbox.kinds import KindRegistry
from outbox.leases import LeaseKeeper
from outbox.observer import Observer, guarded
from outbox.states import State
from outbox.storage import Storage
from outbox.storage.claims import Claimed
from outbox.storage.transitions import Transition
from workers.verdicts import judge_recovery

log = logging.getLogger("workers.executor")

T = TypeVar("T")


class RecoversSent:
    """The executor's recovery lookups (a part of ``Executor``, which has what it uses)."""

    gateway: Gateway
    registry: KindRegistry
    worker: str
    lease_seconds: float
    observer: Observer

    @property
    def storage(self) -> Storage:
        raise NotImplementedError

    @property
    def keeper(self) -> LeaseKeeper:
        raise NotImplementedError

    def _step(self, work: Callable[[Connection], T]) -> T:
        raise NotImplementedError

    def _recover(self, claimed: Claimed, clock: DbClock) -> dict[int, State]:
        """``_look_up_sent``, inside the observer's ``recovering``."""
        with guarded(self.observer).recovering(claimed) as seen:
            written = self._look_up_sent(claimed, clock)
            seen(written.get(claimed.id))
            return written

    def _look_up_sent(self, claimed: Claimed, clock: DbClock) -> dict[int, State]:
        """The worker that sent this died before recording: ask, never re-send.

        The lookup has half a lease from its own start (after the batch's sends), within the
        lease as renewed; one the lease leaves no time for is not asked, and nothing is
        written: the operation stays ``submitted``, and is looked at again once this lease
        lapses (never recorded "unavailable" for a question nobody asked).
        """
        try:
            kind = self.registry.get(claimed.kind)
        except SettledError:
            log.error("cannot look up an unknown kind", extra={"operation_id": claimed.id})
            return {}
        if kind.contract.queryable:
            half = self.lease_seconds / 2
            lease = self.keeper.lease_until(claimed)
            deadline = lookup_deadline(clock, lease, half, least=half)
            if deadline is None:
                log.warning(
                    "recovery lookup not asked: the lease left no time for it",
                    extra={"operation_id": claimed.id},
                )
                return {}
            found = look_up(self.gateway, claimed, kind, deadline=deadline)
            change = judge_recovery(found)
        else:
            change = judge_recovery(None)
        found_out = Transition.of(claimed, change, looked=kind.contract.queryable)
        if not self._step(
            lambda conn: self.storage.write_transitions(conn, [found_out], actor=self.worker)
        ):
            return {}  # refused as stale: a newer claim holds it
        return {claimed.id: found_out.to}
