"""A fake downstream for tests: ``FakeGateway`` implements the ``Gateway`` port in memory.

Test the executor, the reconciler and review logic without HTTP, as Dramatiq's ``StubBroker``
and Procrastinate's ``InMemoryConnector`` let you test without a broker. By default the fake
behaves like a downstream with Stripe-like idempotency and a lookup API:

- a submit executes the request and answers ``Accepted`` with a receipt of the params sent;
- the same key submitted again is not executed again: it answers what the first one did;
- a lookup finds what a key did (``Found``), or answers ``LookupNotFound``;
- the same key with other params is an idempotency error (``Misuse``), and nothing is done;
- a receipt whose reference Settled cannot store (``valid_reference``), scripted, is no proof
  (``Misuse("receipt_unreadable")``; the downstream did carry it out);
- a call whose deadline has already passed is not made (``NotSent`` / ``Unavailable``), and
  neither is one while ``unreachable`` is set (connections refused: ``NotSent`` at connect).

Script other answers, in order, for every key or for one key; what a scripted answer did
downstream is remembered as the real one would be (``Accepted``: done; ``Refused``: a
refusal on record; anything else: nothing done, unless ``executed=True``, the "committed,
then the answer was lost" case)::

    fake = FakeGateway()
    fake.script_submit(Unknown("read timeout"), executed=True)  # done, answer lost
    fake.script_lookup(Unavailable("down"))  # the next lookup, then the default again
    ...
    assert [c.idempotency_key for c in fake.submits] == [key]
    assert fake.effects("acme", key) == 1

Every call is recorded (``calls``) with its tenant, kind, key, params and deadline. Like
every ``Gateway``, it answers the questions of the conformance suite (``outbox.conformance``).
Thread-safe: the executor sends a batch from several threads.

For simulations (``tests/integration/test_simulation.py``) the fake also keeps what a real
downstream and network would, on a clock of the test's own (``clock=``, seconds; by default
``time.monotonic``), so that nothing waits in real time:

- a **ledger** of effects (``ledger``: one ``Effect`` per business effect carried out, with its
  tenant, op_id, key, reference and when; ``effects_of(tenant, op_id)`` counts them per
  operation, whatever the key);
- **scripted latency**: ``hold_submits()`` keeps the next submits on the wire (``in_flight``)
  and answers their sender ``Unknown`` (its client gave up); the test decides when each
  ``land``s, or that it is ``drop``ped. A request that lands after its deadline (the time it
  had left when sent, on the fake's clock) is refused, as a downstream that enforces
  ``Settled-Deadline`` does (``enforces_deadline=False``: it is carried out all the same);
  one that lands in time is carried out, or replays its key. ``clock_behind`` (seconds) is
  how far the downstream's clock runs behind the sender's: the deadline is an instant, read
  on the downstream's clock, so a request held on the wire has that much longer;
- a **visibility delay** (``visibility_delay=``, seconds): what a request did is found by a
  lookup only that long after it was carried out (a submit replaying the key sees it at once);
- **answers lost after commit**: ``script_submit(Unknown(...), executed=True)``, as above;
- **key retention** (``key_retention=``, seconds; None: forever): a key's record is forgotten
  that long after it was made, as a downstream's idempotency store forgets it (Stripe: 24 h);
  a lookup then finds nothing, and a request with the key is carried out again.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from outbox.clock import Deadline
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
    receipt_matches,
    valid_reference,
)
from outbox.port_shim import old_keywords

__all__ = ["Call", "Effect", "FakeGateway", "InFlight"]


@dataclass(frozen=True)
class Call:
    """One call the fake answered."""

    method: Literal["submit", "lookup"]
    tenant: str
    op_id: str
    kind: str  # the kind's name
    idempotency_key: str
    params: Mapping[str, Any]
    deadline: Deadline | datetime
    #: what the fake answered
    outcome: SubmitOutcome | LookupOutcome


@dataclass(frozen=True)
class Effect:
    """One business effect the fake downstream carried out: a line of its ledger."""

    tenant: str
    op_id: str
    idempotency_key: str
    reference: str
    #: the fake's clock when it was carried out
    at: float


@dataclass(frozen=True)
class InFlight:
    """A request on the wire (``hold_submits``): sent, not arrived; it lands or is dropped."""

    id: int
    tenant: str
    op_id: str
    kind: str
    idempotency_key: str
    params: Mapping[str, Any]
    #: the fake's clock when it was sent
    sent_at: float
    #: the time its deadline left it when sent: landing later than that, it is refused
    time_left: float

    def in_time(self, now: float) -> bool:
        """Whether it would arrive before its deadline if it landed at ``now``."""
        return now - self.sent_at < self.time_left


@dataclass(frozen=True)
class _Scripted:
    outcome: Any
    executed: bool | None


class FakeGateway:
    """The downstream port in memory: scripted outcomes, Stripe-like idempotency by default,
    every call recorded (see the module docstring)."""

    def __init__(
        self,
        *,
        reference_prefix: str = "fake",
        clock: Callable[[], float] = time.monotonic,
        visibility_delay: float = 0.0,
        enforces_deadline: bool = True,
        key_retention: float | None = None,
    ) -> None:
        self.calls: list[Call] = []
        #: the fake's own clock (seconds): latency, deadlines on the wire, visibility
        self.clock = clock
        #: a lookup finds what a request did only this long after it was carried out
        self.visibility_delay = visibility_delay
        #: a request on the wire that lands after its deadline is refused (off: only the
        #: test's delay bound stops it, as with a downstream that ignores the deadline)
        self.enforces_deadline = enforces_deadline
        #: a key's record is forgotten this long after it was made (None: never)
        self.key_retention = key_retention
        #: how far the downstream's clock runs behind the sender's (seconds; negative:
        #: ahead): a held request's deadline, an instant, is read on it
        self.clock_behind = 0.0
        #: how many keys' records were forgotten (``key_retention``)
        self.forgotten = 0
        #: no connection can be made: every call answers NotSent (connect) / Unavailable
        self.unreachable = False
        self._prefix = reference_prefix
        self._lock = threading.Lock()
        self._submits: dict[str | None, deque[_Scripted]] = defaultdict(deque)
        self._lookups: dict[str | None, deque[_Scripted]] = defaultdict(deque)
        #: (tenant, key) -> what the downstream did with that key, and what it answered
        self._records: dict[tuple[str, str], tuple[Found, SubmitOutcome]] = {}
        self._effects: dict[tuple[str, str], int] = defaultdict(int)
        self._references = itertools.count(1)
        self._ledger: list[Effect] = []
        #: (tenant, key) -> the fake's clock when its record was made
        self._recorded_at: dict[tuple[str, str], float] = {}
        #: (tenant, key) -> the params of the request that made its record
        self._sent: dict[tuple[str, str], dict[str, Any]] = {}
        self._holds: dict[str | None, int] = defaultdict(int)
        self._wire: dict[int, InFlight] = {}
        self._requests = itertools.count(1)

    # -- scripting ----------------------------------------------------------------------------

    def script_submit(
        self, *outcomes: SubmitOutcome, key: str | None = None, executed: bool | None = None
    ) -> None:
        """Answer the next submits (of ``key``, or of any key) with ``outcomes``, in order.

        ``executed`` says whether the downstream carried the request out: by default only an
        ``Accepted`` did (and a ``Refused`` is a refusal on record, unless ``executed=False``);
        ``executed=True`` with any other answer (``Unknown``, ``Misuse``...) is a request
        carried out downstream whose answer was lost.
        """
        with self._lock:
            self._submits[key].extend(_Scripted(o, executed) for o in outcomes)

    def script_lookup(self, *outcomes: LookupOutcome, key: str | None = None) -> None:
        """Answer the next lookups (of ``key``, or of any key) with ``outcomes``, in order."""
        with self._lock:
            self._lookups[key].extend(_Scripted(o, None) for o in outcomes)

    def hold_submits(self, n: int = 1, *, key: str | None = None) -> None:
        """Keep the next ``n`` submits (of ``key``, or of any key) on the wire: each sender is
        answered ``Unknown`` (its client gave up), and the request waits in ``in_flight``
        until the test ``land``s or ``drop``s it."""
        with self._lock:
            self._holds[key] += n

    @property
    def in_flight(self) -> list[InFlight]:
        """The requests on the wire, oldest first."""
        with self._lock:
            return list(self._wire.values())

    def land(self, request_id: int) -> SubmitOutcome:
        """The request arrives now: refused past its deadline (nothing done); otherwise carried
        out, or a replay of its key. Returns what the downstream answered (nobody hears it)."""
        with self._lock:
            request = self._wire.pop(request_id)
            if self.enforces_deadline and not request.in_time(self.clock()):
                return NotSent("arrived past its deadline: refused", SendPhase.BEFORE)
            tenant, key, params = request.tenant, request.idempotency_key, request.params
            stored = self._stored(tenant, key)
            if stored is not None:
                return self._replay(tenant, key, params, stored[1])
            accepted = Accepted(self._receipt(key, params, "succeeded"))
            self._carry_out(tenant, request.op_id, key, params, Found(accepted.receipt), accepted)
            return accepted

    def drop(self, request_id: int) -> None:
        """The request is lost on the wire: it never arrives."""
        with self._lock:
            del self._wire[request_id]

    # -- what happened ------------------------------------------------------------------------

    @property
    def submits(self) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == "submit"]

    @property
    def lookups(self) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == "lookup"]

    def effects(self, tenant: str, idempotency_key: str) -> int:
        """How many business effects requests with this key had (a refund done): a replay of
        a key the downstream remembers has none, and neither has a refusal."""
        with self._lock:
            return self._effects[(tenant, idempotency_key)]

    def effects_of(self, tenant: str, op_id: str) -> int:
        """How many business effects the ledger holds for the operation, under any key."""
        with self._lock:
            return sum(1 for e in self._ledger if (e.tenant, e.op_id) == (tenant, op_id))

    @property
    def ledger(self) -> list[Effect]:
        """Every business effect carried out, in order."""
        with self._lock:
            return list(self._ledger)

    def record(self, tenant: str, idempotency_key: str) -> Found | None:
        """What the downstream did with this key, as a lookup would find it (None: nothing)."""
        with self._lock:
            stored = self._stored(tenant, idempotency_key)
            return stored[0] if stored is not None else None

    # -- the port -----------------------------------------------------------------------------

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Send one attempt (in memory); see the module docstring for what it answers."""
        tenant, op_id, key, params = _fields(request)
        with self._lock:
            outcome = self._submit(tenant, op_id, request.kind.name, key, params, deadline)
            args = (tenant, op_id, request.kind.name, key, params, deadline, outcome)
            self.calls.append(Call("submit", *args))
            return outcome

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Ask what happened to the request's key; a record is checked against its params."""
        tenant, op_id, key, params = _fields(request)
        with self._lock:
            outcome = self._lookup(tenant, key, params, deadline)
            args = (tenant, op_id, request.kind.name, key, params, deadline, outcome)
            self.calls.append(Call("lookup", *args))
            return outcome

    # -- inside the lock ----------------------------------------------------------------------

    def _submit(
        self,
        tenant: str,
        op_id: str,
        kind: str,
        key: str,
        params: Mapping[str, Any],
        deadline: Deadline | datetime,
    ) -> SubmitOutcome:
        left = _left(deadline)
        if left <= 0:
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        if self.unreachable:
            return NotSent("connection refused: the downstream is unreachable", SendPhase.CONNECT)
        if self._take_hold(key):
            request_id = next(self._requests)
            self._wire[request_id] = InFlight(
                request_id,
                tenant,
                op_id,
                kind,
                key,
                dict(params),
                self.clock(),
                left + self.clock_behind,
            )
            return Unknown("no answer: the request is still on the wire")
        scripted = self._next(self._submits, key)
        if scripted is None:
            stored = self._stored(tenant, key)
            if stored is not None:  # idempotency: the first answer, nothing done again
                return self._replay(tenant, key, params, stored[1])
            scripted = _Scripted(Accepted(self._receipt(key, params, "succeeded")), None)
        outcome: SubmitOutcome = scripted.outcome
        if isinstance(outcome, Accepted):
            self._carry_out(tenant, op_id, key, params, Found(outcome.receipt), outcome)
            if not valid_reference(outcome.receipt.reference):
                return Misuse("receipt_unreadable", "the receipt's reference is not valid", 200)
        elif isinstance(outcome, Refused) and scripted.executed is not False:
            receipt = self._receipt(key, params, "rejected")
            found = Found(receipt, outcome.reason, outcome.code)
            self._carry_out(tenant, op_id, key, params, found, outcome)
        elif scripted.executed:
            accepted = Accepted(self._receipt(key, params, "succeeded"))
            self._carry_out(tenant, op_id, key, params, Found(accepted.receipt), accepted)
        return outcome

    def _replay(
        self, tenant: str, key: str, params: Mapping[str, Any], answer: SubmitOutcome
    ) -> SubmitOutcome:
        """The first answer to a key again; the key with other params is an idempotency
        error (a downstream never answers another request's receipt as this one's)."""
        if self._sent.get((tenant, key)) != dict(params):
            return Misuse("idempotency_error", "the key was used with other params", 400)
        return answer

    def _stored(self, tenant: str, key: str) -> tuple[Found, SubmitOutcome] | None:
        """The key's record, unless the key retention has passed since it was made (then it
        is forgotten: the key is new again)."""
        at = self._recorded_at.get((tenant, key))
        retention = self.key_retention
        if at is not None and retention is not None and self.clock() >= at + retention:
            del self._records[(tenant, key)], self._recorded_at[(tenant, key)]
            self._sent.pop((tenant, key), None)
            self.forgotten += 1
            return None
        return self._records.get((tenant, key))

    def _take_hold(self, key: str) -> bool:
        for which in (key, None):
            if self._holds.get(which, 0) > 0:
                self._holds[which] -= 1
                return True
        return False

    def _lookup(
        self, tenant: str, key: str, params: Mapping[str, Any], deadline: Deadline | datetime
    ) -> LookupOutcome:
        if _left(deadline) <= 0:
            return Unavailable("deadline passed before sending")
        if self.unreachable:
            return Unavailable("ConnectError")
        scripted = self._next(self._lookups, key)
        if scripted is not None:
            result: LookupOutcome = scripted.outcome
            return result
        stored = self._stored(tenant, key)
        if stored is None:
            return LookupNotFound()
        if self.clock() < self._recorded_at[(tenant, key)] + self.visibility_delay:
            return LookupNotFound()  # carried out, not visible yet
        found = stored[0]
        if not receipt_matches(params, found.receipt):
            return LookupMisuse(
                "receipt_mismatch", "the record differs from the intent", found.receipt
            )
        return found

    def _next(self, scripts: dict[str | None, deque[_Scripted]], key: str) -> _Scripted | None:
        for queue in (scripts.get(key), scripts.get(None)):
            if queue:
                return queue.popleft()
        return None

    def _carry_out(
        self,
        tenant: str,
        op_id: str,
        key: str,
        params: Mapping[str, Any],
        found: Found,
        answer: SubmitOutcome,
    ) -> None:
        self._records[(tenant, key)] = (found, answer)
        self._sent[(tenant, key)] = dict(params)
        self._recorded_at[(tenant, key)] = self.clock()
        if found.receipt.status == "succeeded":
            self._effects[(tenant, key)] += 1
            receipt = found.receipt
            self._ledger.append(Effect(tenant, op_id, key, receipt.reference, self.clock()))

    def _receipt(self, key: str, params: Mapping[str, Any], status: str) -> Receipt:
        reference = f"{self._prefix}_{next(self._references)}"
        return Receipt(reference, status, dict(params), {"idempotency_key": key})


def _fields(request: DownstreamRequest) -> tuple[str, str, str, dict[str, Any]]:
    return request.tenant, request.op_id, request.idempotency_key, dict(request.params)


def _left(deadline: Deadline | datetime) -> float:
    if isinstance(deadline, Deadline):
        return deadline.left()
    return (deadline - datetime.now(UTC)).total_seconds()
