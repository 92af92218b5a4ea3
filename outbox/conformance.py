"""The questions every ``Gateway`` answers the same way: a conformance suite for any adapter.

Settled trusts an adapter's outcome values (``outbox.downstream``) to say what a call proved.
This suite asks an adapter the questions that decide it, against a downstream a test can
script, and checks both what the adapter answered and what the downstream did: an accepted
submit, a replay (the same key: the same receipt and no second effect), a conflict (the same
key with other params), each class of refusal (a business refusal, a refusal of permission, a
receipt that does not match, a rate limit: not executed), each phase of a transport failure
(nothing left vs the answer lost after the request left), a deadline already passed, a lookup
found / not found / unavailable / misuse, paging where the adapter pages, and the bounds on
what is accepted as proof (references). docs/gateway-conformance.md says how to run it
against your own adapter.

Run it with pytest: subclass ``GatewayConformance`` in a test module (pytest collects it by a
``Test`` name) and give the class a ``gateway_subject`` fixture that makes a ``Subject``: the
gateway, a ``Downstream`` (the handle that scripts the downstream's next answers and counts
what it did), and the requests it may be asked (``Subject.request``)::

    class TestMyGateway(GatewayConformance):
        pages = None  # or the page size of the adapter's lookup, where it pages

        @pytest.fixture
        def gateway_subject(self, my_downstream):
            with MyGateway(my_downstream.url) as gateway:
                yield Subject(gateway, MyDownstream(my_downstream), my_request)

``FakeDownstream`` is that handle for ``outbox.testing.FakeGateway``; ``settled.simulator.
conformance.SimulatorDownstream`` is one for any adapter that talks to Settled's simulator
(its wire protocol or its Stripe mode). This module does not import pytest: the suite is plain
classes and ``assert``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Protocol

from outbox.downstream import (
    MAX_REFERENCE,
    Accepted,
    DownstreamRequest,
    Found,
    Gateway,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    Unavailable,
    Unknown,
    receipt_matches,
    valid_reference,
)
from outbox.states import RejectReason
from outbox.testing import FakeGateway

__all__ = ["Downstream", "FakeDownstream", "GatewayConformance", "Subject", "vary_amount"]

#: How long each call of the suite may take.
CALL_SECONDS = 10.0
#: The Retry-After a rate limit is scripted with (seconds).
RETRY_AFTER = 7
#: The phases of a send that provably left nothing on the wire (not ``before``: a check
#: before any I/O; not ``unspecified``: an adapter says where it stopped).
NETWORK_PHASES = frozenset(
    {SendPhase.POOL, SendPhase.RESOLVE, SendPhase.CONNECT, SendPhase.TLS, SendPhase.WRITE}
)


class Downstream(Protocol):
    """The downstream behind a gateway, as the suite scripts it. Each ``script`` call is
    about the next submit (or lookup) of that request's key only."""

    def effects(self, request: DownstreamRequest) -> int:
        """How many business effects requests with this key had downstream (a refund
        done): a replay has none, and neither has a refusal."""
        ...

    def refuse_business(self, request: DownstreamRequest) -> None:
        """The next submit is refused on business grounds (the downstream keeps the refusal:
        a replay and a lookup answer it)."""
        ...

    def forbid(self, request: DownstreamRequest) -> None:
        """The next submit is refused for want of permission (the credentials may not do
        this); nothing is done or kept."""
        ...

    def rate_limit(self, request: DownstreamRequest, retry_after: int) -> None:
        """The next submit is refused before processing (rate limited), saying when to come
        back (``retry_after`` seconds); nothing is done or kept."""
        ...

    def mismatch_receipt(self, request: DownstreamRequest) -> None:
        """The next submit is carried out, and its receipt echoes a field other than sent."""
        ...

    def lose_answer(self, request: DownstreamRequest) -> None:
        """The next submit is carried out, and its answer is lost after the request left
        (the connection drops before the answer arrives)."""
        ...

    def lookups_down(self, request: DownstreamRequest) -> None:
        """The next lookup of the key cannot be answered (the downstream is unavailable)."""
        ...

    def unreachable(self) -> AbstractContextManager[None]:
        """Within the block, no connection to the downstream can be made (nothing a call
        sends leaves); after it, it can again."""
        ...


@dataclass
class Subject:
    """An adapter under test: the gateway, the handle on its downstream, and the requests it
    may be asked (``request(key)``: a valid request the downstream can carry out, its key
    ``key`` and an op id of its own; every request of a test is made once, by this)."""

    gateway: Gateway
    downstream: Downstream
    request: Callable[[str], DownstreamRequest]
    #: the request with params of another operation (by default one more of ``amount_minor``)
    vary: Callable[[DownstreamRequest], DownstreamRequest] = dataclasses.field(
        default=lambda request: vary_amount(request)
    )


def vary_amount(request: DownstreamRequest) -> DownstreamRequest:
    """The same request (tenant, op id, key) with one more of ``amount_minor``."""
    params = dict(request.params)
    params["amount_minor"] = int(params["amount_minor"]) + 1
    return dataclasses.replace(request, params=params)


def _deadline(seconds: float = CALL_SECONDS) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def _proof(receipt: Receipt, request: DownstreamRequest, status: str) -> None:
    """A receipt that may settle ``request``: a storable reference, the intent as sent."""
    assert receipt.status == status, receipt
    assert valid_reference(receipt.reference), receipt.reference
    assert len(receipt.reference) <= MAX_REFERENCE
    assert receipt_matches(request.params, receipt), (dict(receipt.params), request)


class GatewayConformance:
    """The suite: subclass it with a ``gateway_subject`` fixture (see the module docstring).

    ``pages``: the page size of the adapter's lookup where it reads the downstream's records in
    pages (the suite then puts the operation past the first page), None where it does not.
    ``keeps_refusals``: whether the downstream keeps a business refusal as a record that a
    lookup finds (the wire protocol does); where it does not (Stripe makes no refund), a
    lookup of a refused request must find nothing.
    ``scripts_references``: whether the ``Downstream`` can answer a receipt with a given
    reference (``answer_reference(request, reference)``), for the bounds on references.
    ``replays_prove``: whether a replay answers the first receipt (most do); where it answers
    only that nothing new was done (Alipay's ``fund_change`` ``N``), the replay must be
    uncertain, never a refusal, and the lookup finds the first receipt.
    """

    pages: ClassVar[int | None] = None
    keeps_refusals: ClassVar[bool] = True
    scripts_references: ClassVar[bool] = False
    replays_prove: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only the questions the adapter can be asked are tests of it: none is skipped.
        refusal = _refusal_found if cls.keeps_refusals else _refusal_not_found
        cls.test_a_lookup_of_a_business_refusal = refusal  # type: ignore[attr-defined]
        if not cls.replays_prove:
            cls.test_a_replay_answers_the_first_receipt_and_does_nothing_again = _replay_unproven  # type: ignore[method-assign]
        if cls.pages:
            cls.test_a_lookup_reads_the_pages_until_it_finds_the_operation = _paging  # type: ignore[attr-defined]
        if cls.scripts_references:
            cls.test_a_reference_settled_cannot_store_is_no_proof = _references  # type: ignore[attr-defined]

    # -- submit -------------------------------------------------------------------------------

    def test_an_accepted_submit_is_carried_out_once(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-accepted")
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Accepted), outcome
        _proof(outcome.receipt, request, "succeeded")
        assert s.downstream.effects(request) == 1

    def test_a_replay_answers_the_first_receipt_and_does_nothing_again(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-replay")
        first = s.gateway.submit(request, deadline=_deadline())
        again = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(first, Accepted) and isinstance(again, Accepted), (first, again)
        assert again.receipt.reference == first.receipt.reference
        assert s.downstream.effects(request) == 1

    def test_the_same_key_with_other_params_is_misuse(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-conflict")
        assert isinstance(s.gateway.submit(request, deadline=_deadline()), Accepted)
        other = s.gateway.submit(s.vary(request), deadline=_deadline())
        assert isinstance(other, Misuse), other  # never the first receipt as proof
        assert s.downstream.effects(request) == 1

    def test_a_business_refusal_is_refused_and_kept(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-business")
        s.downstream.refuse_business(request)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Refused), outcome
        assert outcome.reason is RejectReason.BUSINESS_REJECTED and outcome.code
        assert s.downstream.effects(request) == 0
        again = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(again, Refused) and again.reason is outcome.reason, again
        assert s.downstream.effects(request) == 0

    def test_a_refusal_of_permission_does_nothing(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-forbidden")
        s.downstream.forbid(request)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Refused), outcome
        assert outcome.reason is RejectReason.PERMISSION_DENIED
        assert s.downstream.effects(request) == 0

    def test_a_rate_limit_is_not_executed_and_spends_nothing(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-rate-limited")
        s.downstream.rate_limit(request, RETRY_AFTER)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, NotExecuted), outcome
        assert outcome.retry_after == RETRY_AFTER
        assert s.downstream.effects(request) == 0
        later = s.gateway.submit(request, deadline=_deadline())  # the key was not spent
        assert isinstance(later, Accepted), later
        assert s.downstream.effects(request) == 1

    def test_a_receipt_that_does_not_match_the_intent_is_misuse(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-mismatch")
        s.downstream.mismatch_receipt(request)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Misuse), outcome
        assert outcome.code == "receipt_mismatch"

    # -- transport ----------------------------------------------------------------------------

    def test_a_request_that_never_left_is_not_sent(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-unreachable")
        with s.downstream.unreachable():
            outcome = s.gateway.submit(request, deadline=_deadline())
            looked = s.gateway.lookup(request, deadline=_deadline())
        assert isinstance(outcome, NotSent), outcome
        assert outcome.phase in NETWORK_PHASES, outcome.phase
        assert isinstance(looked, Unavailable) and not looked.pending, looked
        assert s.downstream.effects(request) == 0
        assert isinstance(s.gateway.submit(request, deadline=_deadline()), Accepted)

    def test_an_answer_lost_after_the_request_left_is_unknown(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-lost")
        s.downstream.lose_answer(request)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Unknown), outcome  # never "not sent": it may have been done
        assert s.downstream.effects(request) == 1
        found = s.gateway.lookup(request, deadline=_deadline())
        assert isinstance(found, Found), found
        _proof(found.receipt, request, "succeeded")

    def test_a_deadline_already_passed_sends_nothing(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-late")
        passed = _deadline(-1.0)
        outcome = s.gateway.submit(request, deadline=passed)
        assert isinstance(outcome, NotSent) and outcome.phase is SendPhase.BEFORE, outcome
        assert isinstance(s.gateway.lookup(request, deadline=passed), Unavailable)
        assert s.downstream.effects(request) == 0
        assert isinstance(s.gateway.lookup(request, deadline=_deadline()), LookupNotFound)

    # -- lookup -------------------------------------------------------------------------------

    def test_a_lookup_finds_what_a_key_did(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        request = s.request("cf-found")
        sent = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(sent, Accepted), sent
        found = s.gateway.lookup(request, deadline=_deadline())
        assert isinstance(found, Found) and found.reason is None, found
        _proof(found.receipt, request, "succeeded")
        assert found.receipt.reference == sent.receipt.reference

    def test_a_lookup_of_a_key_never_sent_is_not_found(self, gateway_subject: Subject) -> None:
        s = gateway_subject
        found = s.gateway.lookup(s.request("cf-never-sent"), deadline=_deadline())
        assert isinstance(found, LookupNotFound), found

    def test_a_lookup_the_downstream_cannot_answer_is_unavailable(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-lookup-down")
        assert isinstance(s.gateway.submit(request, deadline=_deadline()), Accepted)
        s.downstream.lookups_down(request)
        looked = s.gateway.lookup(request, deadline=_deadline())
        assert isinstance(looked, Unavailable) and not looked.pending, looked
        assert isinstance(s.gateway.lookup(request, deadline=_deadline()), Found)

    def test_a_record_that_differs_from_the_intent_is_lookup_misuse(
        self, gateway_subject: Subject
    ) -> None:
        s = gateway_subject
        request = s.request("cf-lookup-misuse")
        sent = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(sent, Accepted), sent
        looked = s.gateway.lookup(s.vary(request), deadline=_deadline())
        assert isinstance(looked, LookupMisuse) and looked.code == "receipt_mismatch", looked
        # what the downstream actually did, for a person to settle it by
        assert looked.record is not None and looked.record.reference == sent.receipt.reference


def _replay_unproven(self: GatewayConformance, gateway_subject: Subject) -> None:
    """A replay that proves only that nothing new was done is uncertain (never "not done"),
    does nothing again, and the lookup finds the first receipt."""
    s = gateway_subject
    request = s.request("cf-replay")
    first = s.gateway.submit(request, deadline=_deadline())
    again = s.gateway.submit(request, deadline=_deadline())
    assert isinstance(first, Accepted) and isinstance(again, Unknown), (first, again)
    assert s.downstream.effects(request) == 1
    found = s.gateway.lookup(request, deadline=_deadline())
    assert isinstance(found, Found), found
    assert found.receipt.reference == first.receipt.reference


def _refusal_found(self: GatewayConformance, gateway_subject: Subject) -> None:
    """The downstream keeps a business refusal as a record: a lookup finds it, rejected."""
    s = gateway_subject
    request = s.request("cf-found-refused")
    s.downstream.refuse_business(request)
    assert isinstance(s.gateway.submit(request, deadline=_deadline()), Refused)
    found = s.gateway.lookup(request, deadline=_deadline())
    assert isinstance(found, Found), found
    assert found.receipt.status == "rejected" and found.reason is not None, found


def _refusal_not_found(self: GatewayConformance, gateway_subject: Subject) -> None:
    """The downstream keeps no record of a refusal (Stripe makes no refund): a lookup finds
    nothing, and never a success."""
    s = gateway_subject
    request = s.request("cf-found-refused")
    s.downstream.refuse_business(request)
    assert isinstance(s.gateway.submit(request, deadline=_deadline()), Refused)
    assert isinstance(s.gateway.lookup(request, deadline=_deadline()), LookupNotFound)


def _paging(self: GatewayConformance, gateway_subject: Subject) -> None:
    """The operation past the first page of the downstream's records is found, not "not
    found"."""
    s = gateway_subject
    assert self.pages is not None
    ours = s.request("cf-paged")
    sent = s.gateway.submit(ours, deadline=_deadline())
    assert isinstance(sent, Accepted), sent
    for n in range(self.pages):  # newer records, listed before it
        other = s.gateway.submit(s.request(f"cf-paged-other-{n}"), deadline=_deadline())
        assert isinstance(other, Accepted), other
    found = s.gateway.lookup(ours, deadline=_deadline())
    assert isinstance(found, Found), found
    assert found.receipt.reference == sent.receipt.reference


def _references(self: GatewayConformance, gateway_subject: Subject) -> None:
    """A receipt whose reference is too long, or has characters Settled does not show, is
    not accepted as proof."""
    s = gateway_subject
    answer: Callable[[DownstreamRequest, str], None] = s.downstream.answer_reference  # type: ignore[attr-defined]
    for n, reference in enumerate(["r" * (MAX_REFERENCE + 1), "re_1<script>", "-re_1", ""]):
        request = s.request(f"cf-reference-{n}")
        answer(request, reference)
        outcome = s.gateway.submit(request, deadline=_deadline())
        assert isinstance(outcome, Misuse) and outcome.code == "receipt_unreadable", outcome
    longest = s.request("cf-reference-longest")
    answer(longest, "r" * MAX_REFERENCE)
    outcome = s.gateway.submit(longest, deadline=_deadline())
    assert isinstance(outcome, Accepted) and outcome.receipt.reference == "r" * MAX_REFERENCE


class FakeDownstream:
    """The ``Downstream`` of an ``outbox.testing.FakeGateway`` (it is its own downstream)."""

    def __init__(self, fake: FakeGateway) -> None:
        self.fake = fake

    def effects(self, request: DownstreamRequest) -> int:
        return self.fake.effects(request.tenant, request.idempotency_key)

    def refuse_business(self, request: DownstreamRequest) -> None:
        refused = Refused(RejectReason.BUSINESS_REJECTED, "declined", 402)
        self.fake.script_submit(refused, key=request.idempotency_key)

    def forbid(self, request: DownstreamRequest) -> None:
        refused = Refused(RejectReason.PERMISSION_DENIED, "permission_error", 403)
        self.fake.script_submit(refused, key=request.idempotency_key, executed=False)

    def rate_limit(self, request: DownstreamRequest, retry_after: int) -> None:
        limited = NotExecuted(429, float(retry_after))
        self.fake.script_submit(limited, key=request.idempotency_key)

    def mismatch_receipt(self, request: DownstreamRequest) -> None:
        mismatch = Misuse("receipt_mismatch", "the receipt does not match the intent", 200)
        self.fake.script_submit(mismatch, key=request.idempotency_key, executed=True)

    def lose_answer(self, request: DownstreamRequest) -> None:
        lost = Unknown("ReadTimeout")
        self.fake.script_submit(lost, key=request.idempotency_key, executed=True)

    def lookups_down(self, request: DownstreamRequest) -> None:
        self.fake.script_lookup(Unavailable("503"), key=request.idempotency_key)

    @contextmanager
    def unreachable(self) -> Iterator[None]:
        self.fake.unreachable = True
        try:
            yield
        finally:
            self.fake.unreachable = False

    def answer_reference(self, request: DownstreamRequest, reference: str) -> None:
        receipt = Receipt(reference, "succeeded", dict(request.params))
        self.fake.script_submit(Accepted(receipt), key=request.idempotency_key)
