"""The state behind the simulator's routes: ledger, faults, switches, clock, counters and holds."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from settled.simulator.alipay_keys import AlipayKeys
from settled.simulator.faults import Fault, FaultBook
from settled.simulator.ledger import Ledger
from settled.simulator.messages import Connection


@dataclass(frozen=True)
class Switches:
    """Global behaviour of the downstream, changed through the control API."""

    idempotency: bool = True  # off: every request executes anew
    lookup: bool = True  # off: there is no lookup API (its route answers a bare 404)
    key_retention_seconds: float | None = 24 * 3600.0  # None: keys are never forgotten
    lookup_visibility_delay: float = 0.0  # seconds before a result shows in lookups
    #: refuse (408 deadline_exceeded, nothing executed) a submit that arrives after its
    #: Settled-Deadline; off: execute it anyway, as a downstream without the fence would
    deadline_fence: bool = True
    effects_list: bool = True  # off: there is no list of effects (its route answers a bare 404)


class Simulator:
    """The state behind the HTTP handlers (ledger, faults, switches, clock, holds)."""

    def __init__(
        self, ledger: Ledger, *, test_mode: bool, switches: Switches | None = None
    ) -> None:
        self.ledger = ledger
        self.test_mode = test_mode
        self.faults = FaultBook()
        #: the Alipay mode's key pair and apps (``alipay``)
        self.alipay = AlipayKeys()
        #: the switches it started with (a reset returns to them)
        self.initial_switches = switches or Switches()
        self.switches = self.initial_switches
        #: makes "check the key, then mark it in flight" one step
        self.idempotency_lock = threading.Lock()
        self.stopping = threading.Event()
        self._clock_offset = 0.0
        self._requests: Counter[tuple[str, str, str]] = Counter()
        #: faults that acted on a request, by fault name (a drawn fault that found nothing
        #: to act on, e.g. ``503_after_commit`` on a replay, is not counted)
        self._injected: Counter[str] = Counter()
        self._deadlines: dict[tuple[str, str], str] = {}
        #: the Stripe mode's refunds made other than ``succeeded`` (the ``refund_status``
        #: fault), by refund id: the status it was made with and the one it has now
        self.stripe_refunds: dict[str, dict[str, str | None]] = {}
        self._lock = threading.Lock()
        self._release = threading.Condition()
        self._release_generation = 0

    # -- clock --------------------------------------------------------------------------

    def now(self) -> float:
        return time.time() + self._clock_offset

    def advance_clock(self, seconds: float) -> None:
        with self._lock:
            self._clock_offset += seconds

    def retention_floor(self) -> float | None:
        retention = self.switches.key_retention_seconds
        return None if retention is None else self.now() - retention

    # -- counters -----------------------------------------------------------------------

    def count_request(self, phase: str, tenant: str, key: str, deadline: str | None) -> int:
        """Number this request among those of its (phase, tenant, key), from 1."""
        with self._lock:
            self._requests[(phase, tenant, key)] += 1
            if deadline is not None:
                self._deadlines[(tenant, key)] = deadline
            return self._requests[(phase, tenant, key)]

    def note_injected(self, fault: Fault) -> None:
        """Count ``fault`` as injected: it acted on the request being served."""
        with self._lock:
            self._injected[fault.value] += 1

    def injected(self) -> dict[str, int]:
        """Faults injected so far, by fault name (since start or the last reset)."""
        with self._lock:
            return dict(sorted(self._injected.items()))

    def requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "phase": phase,
                    "tenant": tenant,
                    "idempotency_key": key,
                    "count": count,
                    "last_deadline": self._deadlines.get((tenant, key)),
                }
                for (phase, tenant, key), count in sorted(self._requests.items())
            ]

    # -- holds --------------------------------------------------------------------------

    def release_holds(self) -> None:
        with self._release:
            self._release_generation += 1
            self._release.notify_all()

    def hold(self, connection: Connection, seconds: float) -> str:
        """Wait until released, stopped, the client hung up, or ``seconds`` passed; say which."""
        end = time.monotonic() + seconds
        with self._release:
            generation = self._release_generation
        while True:
            if self.stopping.is_set():
                return "stopping"
            if time.monotonic() >= end:
                return "expired"
            with self._release:
                if self._release_generation != generation:
                    return "released"
                self._release.wait(0.02)
            if connection.peer_closed():
                return "client_gone"

    def reset(self) -> None:
        self.ledger.reset()
        self.faults.clear()
        self.alipay.clear()
        with self._lock:
            self.switches = self.initial_switches
            self._clock_offset = 0.0
            self._requests.clear()
            self._injected.clear()
            self._deadlines.clear()
            self.stripe_refunds.clear()
        self.release_holds()
