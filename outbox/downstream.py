"""The downstream port: what workers, the reconciler and staff tools talk to a downstream
service through, and the outcome values its calls return.

Both calls take one value, the ``DownstreamRequest`` (the operation as the downstream is
asked about it), and the deadline. They return values for every expected outcome; each value
says what it *proves* (docs/DESIGN.md, "What an outcome proves"). Only programming errors
raise. Pure: no database, no network; adapters (``workers.http_client``) and fakes implement
``Gateway``, and the conformance suite (``outbox.conformance``) asks any of them the same
questions.

An adapter still written with the six keywords of earlier releases is called the old way
for one more release (``outbox.port_shim``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol

from outbox.clock import DbClock, Deadline
from outbox.kinds import Kind
from outbox.states import RejectReason, State


class Proof(enum.StrEnum):
    DONE = "done"
    NOT_DONE = "not_done"
    NOT_SENT = "not_sent"
    NOT_EXECUTED = "not_executed"
    UNKNOWN = "unknown"
    MISUSE = "misuse"


@dataclass(frozen=True)
class Receipt:
    """The downstream's proof of a business outcome."""

    reference: str  # the downstream's id for the effect (e.g. "re_...")
    status: str  # "succeeded" or "rejected"
    params: Mapping[str, Any]  # the intent fields as the downstream recorded them
    raw: Mapping[str, Any] = field(default_factory=dict)  # the whole body, for evidence

    def as_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "status": self.status, "params": dict(self.params)}


@dataclass(frozen=True)
class Accepted:
    """2xx with a receipt that matches the intent: done."""

    receipt: Receipt
    #: the HTTP status of the answer (None: not an HTTP answer, e.g. a fake's)
    status: int | None = None
    proof: Proof = Proof.DONE
    #: the downstream's id for the request (Stripe's ``Request-Id``), for support to quote
    request_id: str | None = None


@dataclass(frozen=True)
class Refused:
    """A definite refusal: not done."""

    reason: RejectReason
    code: str  # the downstream's machine-readable code
    status: int
    proof: Proof = Proof.NOT_DONE
    request_id: str | None = None


class SendPhase(enum.StrEnum):
    """Where a send that left nothing stopped (``NotSent.phase``, in the attempt's detail)."""

    #: not said (a scripted or older outcome)
    UNSPECIFIED = "unspecified"
    #: a check before any I/O: the deadline or the lease had passed
    BEFORE = "before"
    #: waiting for a connection of the pool
    POOL = "pool"
    #: resolving the downstream's name
    RESOLVE = "resolve"
    #: the TCP connect
    CONNECT = "connect"
    #: the TLS handshake
    TLS = "tls"
    #: the request's first byte, refused because the attempt's bound had passed
    WRITE = "write"


@dataclass(frozen=True)
class NotSent:
    """Nothing reached the downstream (connection refused, DNS failure, the bound passed
    before the request's first byte); ``phase`` says where the attempt stopped."""

    detail: str
    phase: SendPhase = SendPhase.UNSPECIFIED
    proof: Proof = Proof.NOT_SENT


@dataclass(frozen=True)
class NotExecuted:
    """The downstream refused before processing (429, or a status its contract documents)."""

    status: int
    retry_after: float | None = None  # seconds, already parsed
    proof: Proof = Proof.NOT_EXECUTED
    request_id: str | None = None


@dataclass(frozen=True)
class Unknown:
    """The request may have been processed: timeout after send, reset, other 5xx."""

    detail: str
    status: int | None = None
    proof: Proof = Proof.UNKNOWN
    request_id: str | None = None


@dataclass(frozen=True)
class Misuse:
    """Idempotency error, or a receipt that does not match the intent: needs a person."""

    code: str  # "idempotency_error" | "receipt_mismatch" | ...
    detail: str
    status: int | None = None
    proof: Proof = Proof.MISUSE
    request_id: str | None = None


SubmitOutcome = Accepted | Refused | NotSent | NotExecuted | Unknown | Misuse


@dataclass(frozen=True)
class Found:
    """The downstream knows the key: its business outcome and receipt."""

    receipt: Receipt
    reason: RejectReason | None = None  # set when receipt.status == "rejected"
    code: str | None = None


@dataclass(frozen=True)
class LookupNotFound:
    """The downstream has no record of the key (as far as it can see now)."""


#: ``LookupNotFound`` as 0.1 named it (``outbox.NotFound`` is the status API's error): an
#: adapter written for 0.1 keeps working for one release.
NotFound = LookupNotFound


@dataclass(frozen=True)
class Unavailable:
    """The lookup could not be answered (down, timed out, no lookup API); or, with ``pending``,
    it found the operation taken on but not finished (a Stripe refund ``pending``): it may still
    succeed or fail, so nobody may settle it, not even a supervisor's override, until it does."""

    detail: str
    pending: bool = False


@dataclass(frozen=True)
class LookupMisuse:
    """The lookup found a record that does not match the intent."""

    code: str
    detail: str
    #: the downstream's record, where it is ours but differs from the intent (what the
    #: downstream actually did); None where it is not ours or cannot be stored
    record: Receipt | None = None


LookupOutcome = Found | LookupNotFound | Unavailable | LookupMisuse


@dataclass(frozen=True)
class Effect:
    """One business effect the downstream holds under one of Settled's keys, as its list shows
    it (the orphan-effect audit, ``support.audit``): its reference, what it did and when, and
    the operation it names (``op_id`` None where the downstream keeps only the key)."""

    downstream: str
    tenant: str
    reference: str
    idempotency_key: str | None
    op_id: str | None
    amount_minor: int | None
    currency: str | None
    status: str
    created: datetime | None


@dataclass(frozen=True)
class EffectsListed:
    """What a downstream's list showed for a tenant since a time; ``complete`` False where it
    stopped early (its deadline, a page it could not read): ``detail`` says why."""

    effects: tuple[Effect, ...]
    complete: bool = True
    detail: str | None = None


@dataclass(frozen=True)
class NotListed:
    """The downstream cannot be audited this way (it lists no effects, or refused): why."""

    detail: str


EffectsOutcome = EffectsListed | NotListed


def listed_so_far(effects: list[Effect], detail: str) -> EffectsOutcome:
    """What a list read before it stopped (``detail`` says why): those effects, marked
    incomplete; none read: not listed."""
    return EffectsListed(tuple(effects), False, detail) if effects else NotListed(detail)


class EffectLister(Protocol):
    """A gateway that can list the effects it made for a tenant since a time (optional)."""

    def effects_since(
        self, tenant: str, since: datetime, /, *, deadline: Deadline | datetime
    ) -> EffectsOutcome:
        """Every effect of ``tenant`` made at or after ``since``, read page after page while
        ``deadline`` lasts; never sends anything that has an effect."""
        ...


def mismatch_evidence(lookup: LookupMisuse) -> dict[str, Any]:
    """What a mismatched lookup proves, as evidence: its code and detail, and the record the
    downstream holds (its reference and status: what it actually did), where it is ours, so
    staff see what to confirm and are offered only the outcome it proves."""
    evidence: dict[str, Any] = {"code": lookup.code, "detail": lookup.detail}
    if lookup.record is not None:
        evidence["record"] = {
            "reference": lookup.record.reference,
            "status": lookup.record.status,
        }
    return evidence


@dataclass(frozen=True)
class Settlement:
    """What a downstream's record of the operation settles it as."""

    state: State  # SUCCEEDED or REJECTED
    reason: RejectReason | None
    receipt: dict[str, Any]
    #: the downstream's refusal code, for the event (empty where it succeeded)
    evidence: dict[str, Any] = field(default_factory=dict)


def settlement(found: Found) -> Settlement:
    """A lookup found the downstream's record: succeeded, or rejected with the downstream's
    reason (``business_rejected`` where it gives none). The one rule for a worker recovering
    an abandoned send, the reconciler and staff alike."""
    receipt = found.receipt.as_dict()
    if found.receipt.status == "succeeded":
        return Settlement(State.SUCCEEDED, None, receipt)
    reason = found.reason or RejectReason.BUSINESS_REJECTED
    return Settlement(State.REJECTED, reason, receipt, {"code": found.code})


def lookup_name(lookup: LookupOutcome | None) -> str:
    """The one name of a lookup's result in evidence, events and messages (None: no lookup)."""
    if lookup is None:
        return "none"
    if isinstance(lookup, Unavailable) and lookup.pending:
        return "pending"
    return {
        Found: "found",
        LookupNotFound: "not_found",
        Unavailable: "unavailable",
        LookupMisuse: "mismatch",
    }[type(lookup)]


class Addressed(Protocol):
    """What a lookup needs of an operation (a claim, a stored row)."""

    @property
    def tenant(self) -> str: ...
    @property
    def op_id(self) -> str: ...
    @property
    def idempotency_key(self) -> str: ...
    @property
    def params(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class DownstreamRequest:
    """One operation as a gateway is asked about it: the one value every ``Gateway`` call
    takes (with the deadline beside it).

    ``op_id`` is the operation's identity with ``tenant``; a gateway may name it to the
    downstream (the Stripe gateway's metadata) or ignore it (the key is derived from it).
    ``params`` is a read-only copy of the intent's fields, made when the request is
    (``dict(request.params)`` for a JSON body). Not in the repr: intent fields are no log's
    business.
    """

    tenant: str
    op_id: str
    kind: Kind
    idempotency_key: str
    params: Mapping[str, Any] = field(repr=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("tenant", "op_id", "idempotency_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"DownstreamRequest.{name} must be a non-empty str")
        if not isinstance(self.kind, Kind):
            raise TypeError("DownstreamRequest.kind must be a Kind (outbox.kinds)")
        if not isinstance(self.params, Mapping):
            raise TypeError("DownstreamRequest.params must be a mapping")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @classmethod
    def of(cls, operation: Addressed, kind: Kind) -> DownstreamRequest:
        """The request for an operation (a claim, a stored row) of ``kind``."""
        return cls(
            operation.tenant, operation.op_id, kind, operation.idempotency_key, operation.params
        )


class Gateway(Protocol):
    """The downstream, as workers, the reconciler and staff tools see it."""

    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Send one attempt of ``request``; never retries; never spends past ``deadline``.

        Nothing may leave after ``deadline``: a send that cannot start in time is ``NotSent``.
        A ``datetime`` is a deadline on this process's wall clock.
        """
        ...

    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Ask what happened to the operation (``request.tenant``, ``request.op_id``) sent with
        ``request.idempotency_key``; the receipt is checked against ``request.params``."""
        ...


#: The longest downstream reference Settled stores (the ``downstream_ref`` column).
MAX_REFERENCE = 200
_REFERENCE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_REFERENCE - 1}}}", re.ASCII)


def valid_reference(reference: object) -> bool:
    """A downstream reference Settled can store and show: ASCII letters, digits and ``_.:-``,
    at most MAX_REFERENCE characters. Anything else is not accepted as proof."""
    return isinstance(reference, str) and _REFERENCE.fullmatch(reference) is not None


def receipt_misfit(
    receipt: Receipt, params: Mapping[str, Any], key: str | None, echoed: object
) -> str | None:
    """Why ``receipt`` cannot settle the operation sent with ``key`` and intent ``params``
    (None: it can), the one check of every adapter: ``receipt_unreadable`` (its reference is
    not one Settled can store), ``receipt_key_mismatch`` (the key it echoes, ``echoed``, is
    another; None: it echoes none), ``receipt_mismatch`` (a field it echoes is not the
    intent's)."""
    if not valid_reference(receipt.reference):
        return "receipt_unreadable"
    if key is not None and echoed is not None and echoed != key:
        return "receipt_key_mismatch"
    if not receipt_matches(params, receipt):
        return "receipt_mismatch"
    return None


def receipt_matches(params: Mapping[str, Any], receipt: Receipt) -> bool:
    """True when every intent field the downstream echoed back equals the intent's."""
    return all(receipt.params.get(name) == value for name, value in params.items())


def look_up(
    gateway: Gateway, claimed: Addressed, kind: Kind, *, deadline: Deadline
) -> LookupOutcome:
    """Ask the downstream about an operation, within ``deadline``."""
    return gateway.lookup(DownstreamRequest.of(claimed, kind), deadline=deadline)


def lookup_deadline(
    clock: DbClock, lease_until: datetime | None, seconds: float, *, least: float
) -> Deadline | None:
    """A lookup's own time: ``seconds`` from now, when it starts, and never past the lease as
    its holder holds it now (``lease_until``, database time: ``LeaseKeeper.lease_until``).

    None when the lease is lost (``lease_until`` None) or leaves less than ``least`` seconds:
    the lookup is not to be asked. A lookup never asked is no evidence of anything, not even
    of an unavailable downstream: its operation is looked at again, and nothing is recorded
    as its answer.
    """
    if lease_until is None:
        return None
    lease = clock.deadline(lease_until)
    left = lease.left()
    if left <= 0 or left < least:
        return None
    return lease.capped(seconds)
