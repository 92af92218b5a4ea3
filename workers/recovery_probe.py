"""The recovery probe (on beat): is a downstream that refused us back? If so, wake what waits.

Sends wake the operations waiting after refusals when they come back answered
(``workers.waking``); but when every operation of a downstream waits on backoff, nothing is
sent to it, and nothing would tell us it is back before the next backoff ends (minutes, at the
contract's ``retry_cap``). So on each beat, for each downstream that has operations waiting
after refusals and none being sent (``outbox.storage.waking.probe_target``), the probe looks up
one waiting operation's key: a read-only call, bounded by ``timeout``, that the downstream
answers "found" or "not found" once it is back (``workers.downstreams.proves_back``). Then it
wakes a bounded batch, as a send would; the caller hints them. Nothing waits, no probe; a
``Retry-After`` of the downstream that still holds, no probe. Only a kind with a lookup API is
probed (a downstream without one is woken by sends only).

Not the deadline-fence probe of a start (``settled.preflight``): this one asks only whether
the downstream answers, and changes nothing but ``next_attempt_at`` of waiting operations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import DbClock, Monotonic
from outbox.downstream import DownstreamRequest, Gateway, LookupOutcome
from outbox.kinds import KindRegistry
from outbox.storage import storage_for
from outbox.storage.operations import db_time
from outbox.storage.waking import probe_target
from workers.downstreams import Downstreams, proves_back
from workers.waking import wake

log = logging.getLogger(__name__)

#: The longest a probe's lookup may take: a downstream slower than this is not back yet.
PROBE_SECONDS = 2.0


@dataclass
class RecoveryProbe:
    """Probes each downstream that operations wait for; built once per process (runtime)."""

    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    downstreams: Downstreams
    #: the most operations one successful probe wakes (the executor's ``max_batch``)
    limit: int = 32
    timeout: float = PROBE_SECONDS
    monotonic: Monotonic = time.monotonic

    def run_once(self) -> list[int]:
        """Probe each downstream operations wait for after refusals; the ids woken."""
        storage = storage_for(self.sessions)
        woken: list[int] = []
        for downstream, kinds in self.downstreams.served(self.registry.names()).items():
            queryable = [k for k in kinds if self.registry.get(k).contract.queryable]
            mono = self.monotonic()
            with self.sessions() as session:
                target = probe_target(session, kinds=queryable)
                now = db_time(session)
            if target is None:
                continue
            kind = self.registry.get(target.kind)
            clock = DbClock(now, mono, self.monotonic)
            deadline = clock.deadline(now + timedelta(seconds=self.timeout))
            try:
                answer: LookupOutcome = self.gateway.lookup(
                    DownstreamRequest.of(target, kind), deadline=deadline
                )
            except Exception:  # a gateway returns values; a bug here must not stop the beat
                log.exception("recovery probe failed", extra={"downstream": downstream})
                continue
            if not proves_back(answer):
                log.info(
                    "recovery probe: not back yet",
                    extra={"downstream": downstream, "lookup": type(answer).__name__},
                )
                continue
            woken += wake(storage, downstream, kinds, self.limit, by="recovery_probe")
        return woken
