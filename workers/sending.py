"""The executor's second step: send a batch, a thread each, no transaction open, every send
bounded by its lease, and write the outcomes as they come back (``workers.outcomes``).

One slow send never holds up the other outcomes of its batch, and a batch whose sends come
back together is one write (``SendsBatches._send_and_record``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import datetime, timedelta

from outbox.clock import DbClock, Deadline
from outbox.downstream import DownstreamRequest, Gateway, NotSent, SendPhase, SubmitOutcome
from outbox.kinds import Kind
from outbox.observer import Observer, guarded
from outbox.states import State
from outbox.storage.claims import Claimed
from workers.failpoints import failpoint
from workers.outcomes import RecordsOutcomes, Sent

log = logging.getLogger("workers.executor")


def send_bound(lease_until: datetime, deadline: datetime, clock_margin: float) -> datetime:
    """When an attempt must be over, in database time: the operation's deadline, or its
    lease's end less the clock margin (seconds), whichever comes first. A downstream whose
    clock is within the margin of the database's then refuses the request (its
    ``Settled-Deadline``) by the lease's end: what the reconciler's quiescence counts on
    (``reconciler.decide.Situation.quiet_at``). Pure: the model checker calls it too."""
    return min(deadline, lease_until - timedelta(seconds=clock_margin))


class SendsBatches(RecordsOutcomes):
    """The executor's sending (a part of ``Executor``, which has what it uses)."""

    gateway: Gateway
    max_batch: int
    clock_margin: float
    record_linger: float
    observer: Observer
    _pool: ThreadPoolExecutor | None
    _making: threading.Lock

    def _send_and_record(self, batch: list[tuple[Claimed, Kind, DbClock]]) -> dict[int, State]:
        """Send the batch, a thread each, and write the outcomes as they come back.

        The first answer back is written in one step with those that follow it, each within
        as long as the batch has been out (at least ``record_linger``) of the one before:
        sends that start together to one downstream come back spread over about their own
        length (measured here: 32 to the simulator on a loaded two-core machine came back
        over 0.1 to 1.2 s, up to 0.33 s apart), and a batch written in one step is one
        statement on PostgreSQL. These are written by twice the time the slowest of them
        took, never held for a slow send (30 s where the others took 0.3 s): the late ones
        are written as they come back, with any back within ``record_linger``. A send that
        raised (a bug: a gateway returns values) is left ``submitted`` for the reconciler to
        look up, the others are written, and its error raised after.
        """
        if len(batch) <= 1:
            return self._record_sent([self._send_one(*one) for one in batch], first=True)
        with self._making:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.max_batch), thread_name_prefix="settled-send"
                )
            pool = self._pool
        started = time.monotonic()  # waits on threads, in real time: not the injected clock
        order = {pool.submit(self._send_one, *one): n for n, one in enumerate(batch)}
        pending: set[Future[Sent]] = set(order)
        written: dict[int, State] = {}
        error: BaseException | None = None
        first = True
        while pending:
            back, pending = wait(pending, return_when=FIRST_COMPLETED)
            while pending:  # more, while they keep coming back
                out = time.monotonic() - started if first else 0.0
                more, pending = wait(
                    pending, timeout=max(self.record_linger, out), return_when=FIRST_COMPLETED
                )
                if not more:
                    break
                back |= more
            sent: list[Sent] = []
            for future in sorted(back, key=order.__getitem__):
                if future.exception() is None:
                    sent.append(future.result())
                elif error is None:
                    error = future.exception()
            if sent:
                written.update(self._record_sent(sent, first=first))
                first = False
        if error is not None:
            raise error
        return written

    def _record_sent(self, sent: list[Sent], *, first: bool) -> dict[int, State]:
        if not sent:
            return {}
        if first:
            failpoint("after_send")  # sent (some of the batch at least), nothing recorded
        return self._record(sent)

    def send_deadline(self, claimed: Claimed, clock: DbClock) -> Deadline:
        """When this attempt must be over: the operation's deadline, or its lease's end less
        the clock margin, whichever comes first (database time: ``send_bound``), on the
        claim's clock."""
        return clock.deadline(send_bound(claimed.lease_until, claimed.deadline, self.clock_margin))

    def _send_one(self, claimed: Claimed, kind: Kind, clock: DbClock) -> Sent:
        """``_attempt``, inside the observer's ``sending``."""
        with guarded(self.observer).sending(claimed) as seen:
            sent = self._attempt(claimed, kind, clock)
            seen(sent.outcome)
            return sent

    def _attempt(self, claimed: Claimed, kind: Kind, clock: DbClock) -> Sent:
        deadline = self.send_deadline(claimed, clock)
        outcome: SubmitOutcome
        if deadline.left() <= 0:
            # Delayed past the lease (a pause, a queue): another worker or the reconciler may
            # own the operation now. Provably nothing was sent.
            log.warning("not sent: the lease ended first", extra={"operation_id": claimed.id})
            outcome = NotSent("the lease ended before sending", SendPhase.BEFORE)
        else:
            outcome = self.gateway.submit(DownstreamRequest.of(claimed, kind), deadline=deadline)
        return Sent(claimed, kind, outcome, clock.now())
