"""A fake downstream for tests: ``FakeGateway`` implements the ``Gateway`` port in memory.

Test the executor, the reconciler and review logic without HTTP, as Dramatiq's ``StubBroker``
and Procrastinate's ``InMemoryConnector`` let you test without a broker. By default the fake
behaves like a downstream with Stripe-like idempotency and a lookup API:

- a submit executes the request and answers ``Accepted`` with a receipt of the params sent;
- the same key submitted again is not executed again: it answers what the first one did;
- a lookup finds what a key did (``Found``), or answers ``NotFound``;
- a call whose deadline has already passed is not made (``NotSent`` / ``Unavailable``).

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

Every call is recorded (``calls``) with its tenant, kind, key, params and deadline.
Thread-safe: the executor sends a batch from several threads.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from outbox.clock import Deadline
from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    LookupOutcome,
    NotFound,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    receipt_matches,
)
from outbox.kinds import Kind

__all__ = ["Call", "FakeGateway"]


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
class _Scripted:
    outcome: Any
    executed: bool | None


class FakeGateway:
    """The downstream port in memory: scripted outcomes, Stripe-like idempotency by default,
    every call recorded (see the module docstring)."""

    def __init__(self, *, reference_prefix: str = "fake") -> None:
        self.calls: list[Call] = []
        self._prefix = reference_prefix
        self._lock = threading.Lock()
        self._submits: dict[str | None, deque[_Scripted]] = defaultdict(deque)
        self._lookups: dict[str | None, deque[_Scripted]] = defaultdict(deque)
        #: (tenant, key) -> what the downstream did with that key, and what it answered
        self._records: dict[tuple[str, str], tuple[Found, SubmitOutcome]] = {}
        self._effects: dict[tuple[str, str], int] = defaultdict(int)
        self._references = itertools.count(1)

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

    def record(self, tenant: str, idempotency_key: str) -> Found | None:
        """What the downstream did with this key, as a lookup would find it (None: nothing)."""
        with self._lock:
            stored = self._records.get((tenant, idempotency_key))
            return stored[0] if stored is not None else None

    # -- the port -----------------------------------------------------------------------------

    def submit(
        self,
        *,
        tenant: str,
        op_id: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: Deadline | datetime,
    ) -> SubmitOutcome:
        """Send one attempt (in memory); see the module docstring for what it answers."""
        with self._lock:
            outcome = self._submit(tenant, idempotency_key, params, deadline)
            args = (tenant, op_id, kind.name, idempotency_key, dict(params), deadline, outcome)
            self.calls.append(Call("submit", *args))
            return outcome

    def lookup(
        self,
        *,
        tenant: str,
        op_id: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: Deadline | datetime,
    ) -> LookupOutcome:
        """Ask what happened to ``idempotency_key``; a record is checked against ``params``."""
        with self._lock:
            outcome = self._lookup(tenant, idempotency_key, params, deadline)
            args = (tenant, op_id, kind.name, idempotency_key, dict(params), deadline, outcome)
            self.calls.append(Call("lookup", *args))
            return outcome

    # -- inside the lock ----------------------------------------------------------------------

    def _submit(
        self, tenant: str, key: str, params: Mapping[str, Any], deadline: Deadline | datetime
    ) -> SubmitOutcome:
        if _left(deadline) <= 0:
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        scripted = self._next(self._submits, key)
        if scripted is None:
            stored = self._records.get((tenant, key))
            if stored is not None:
                return stored[1]  # idempotency: the first answer, nothing done again
            scripted = _Scripted(Accepted(self._receipt(key, params, "succeeded")), None)
        outcome: SubmitOutcome = scripted.outcome
        if isinstance(outcome, Accepted):
            self._carry_out(tenant, key, Found(outcome.receipt), outcome)
        elif isinstance(outcome, Refused) and scripted.executed is not False:
            receipt = self._receipt(key, params, "rejected")
            self._carry_out(tenant, key, Found(receipt, outcome.reason, outcome.code), outcome)
        elif scripted.executed:
            accepted = Accepted(self._receipt(key, params, "succeeded"))
            self._carry_out(tenant, key, Found(accepted.receipt), accepted)
        return outcome

    def _lookup(
        self, tenant: str, key: str, params: Mapping[str, Any], deadline: Deadline | datetime
    ) -> LookupOutcome:
        if _left(deadline) <= 0:
            return Unavailable("deadline passed before sending")
        scripted = self._next(self._lookups, key)
        if scripted is not None:
            result: LookupOutcome = scripted.outcome
            return result
        stored = self._records.get((tenant, key))
        if stored is None:
            return NotFound()
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

    def _carry_out(self, tenant: str, key: str, found: Found, answer: SubmitOutcome) -> None:
        self._records[(tenant, key)] = (found, answer)
        if found.receipt.status == "succeeded":
            self._effects[(tenant, key)] += 1

    def _receipt(self, key: str, params: Mapping[str, Any], status: str) -> Receipt:
        reference = f"{self._prefix}_{next(self._references)}"
        return Receipt(reference, status, dict(params), {"idempotency_key": key})


def _left(deadline: Deadline | datetime) -> float:
    if isinstance(deadline, Deadline):
        return deadline.left()
    return (deadline - datetime.now(UTC)).total_seconds()
