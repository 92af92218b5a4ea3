"""Refunds through Stripe's official SDK: the ``Gateway`` port under the same guarantees as the
HTTP gateway (docs/providers.md, "Pointing Settled at Stripe").

One ``StripeClient`` per tenant key, the API version pinned, the SDK's own retries off
(``max_network_retries=0``: the executor is the one retry owner; the SDK's defaults would
multiply attempts). The HTTP client under the SDK is Settled's own (``DeadlineHttpClient``):
it makes exactly one request per call over the bounded transport (``workers.transport``), so the
whole request, its answer included, ends by the operation's deadline and no byte of it leaves
after (a single float timeout is applied by httpx per read: an answer trickling one byte per
read held a send for as long as it liked), and the httpx error of a failed request stays
chained as the SDK error's cause, so a connection error is split by phase (nothing sent vs
maybe sent).

A refund is created with the stored idempotency key as Stripe's ``Idempotency-Key`` and the
tenant, the op id, the key and the payee in ``metadata``; the refund intent's ``order_id`` is
the Stripe PaymentIntent, read before each create (Stripe refunds in the charge's currency: an
intent in another currency is refused, nothing sent). A lookup never sends again: it lists the
payment intent's refunds and finds the one whose metadata names the operation (tenant and op
id); Stripe's 404 for a payment intent it does not know is a "not found". Every outcome keeps
Stripe's ``Request-Id`` of the answer it was read from, and a success its status code.

Each answer's ``Date`` (whole seconds: Stripe says its time nowhere else) is told to the
process's clock watch, as the wire protocol's time is (``workers.downstream_time``): every
request of a call (the intent read, the create, each page of a list) is one round trip
measured.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import stripe
from pydantic import SecretStr

from outbox import wire
from outbox.clock import Deadline
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Effect,
    EffectsListed,
    EffectsOutcome,
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    NotListed,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    listed_so_far,
)
from outbox.port_shim import old_keywords
from outbox.states import RejectReason
from workers.downstream_time import TimeSeen, tell_time
from workers.stripe_classify import (
    KEY_FIELD,
    OP_ID_FIELD,
    PAYEE_FIELD,
    PENDING,
    TENANT_FIELD,
    answered,
    classify_error,
    classify_intent,
    classify_intent_error,
    classify_refund,
    intent_missing,
    misfit,
    receipt_of,
    refusal_code,
)
from workers.transport import BoundedTransport, bound_request

log = logging.getLogger(__name__)

#: The Stripe API version every request names (the one the pinned SDK is generated for).
API_VERSION = "2026-10-28.endive"
#: Stripe's API (its test mode too: a ``sk_test_`` key selects it).
DEFAULT_API_BASE = "https://api.stripe.com"
#: Refunds per page of a lookup's list (Stripe's largest page); a lookup reads the pages
#: one after another until it finds the operation, the list ends, or its deadline passes.
LIST_LIMIT = 100
#: A request's bound where no deadline was given for the thread (``DeadlineHttpClient.within``).
UNBOUNDED_SECONDS = 10.0


class DeadlineHttpClient(stripe.HTTPClient):
    """The SDK's HTTP client: one httpx request per call, over the bounded transport unless
    given another, the whole request ended by the caller's deadline, its transport errors
    chained as the cause of the SDK's error; each answer's ``Date`` told to ``time_seen``
    (measured on the deadline, for the downstream named with it)."""

    name = "settled-httpx"

    def __init__(
        self, transport: httpx.BaseTransport | None = None, *, time_seen: TimeSeen | None = None
    ) -> None:
        super().__init__()
        self._http = httpx.Client(
            transport=transport or BoundedTransport(), trust_env=False, follow_redirects=False
        )
        self._deadline = threading.local()
        self._time_seen = time_seen

    def within(self, deadline: Deadline, downstream: str | None = None) -> None:
        """Bound this thread's next requests by ``deadline``; their answers' time is that of
        ``downstream`` (the kind's name; None: not measured)."""
        self._deadline.value = deadline
        self._deadline.downstream = downstream

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        post_data: Any = None,
        *,
        _usage: list[str] | None = None,
    ) -> tuple[Any, int, Mapping[str, str]]:
        deadline: Deadline | None = getattr(self._deadline, "value", None)
        downstream: str | None = getattr(self._deadline, "downstream", None)
        if deadline is None:
            deadline = Deadline(
                datetime.now(UTC) + timedelta(seconds=UNBOUNDED_SECONDS),
                time.monotonic() + UNBOUNDED_SECONDS,
            )
        began = deadline.monotonic()
        try:
            # The float is httpx's per-phase timeout (what is left now); the bound is what ends
            # the whole request, the answer's every byte included.
            with bound_request(deadline):
                response = self._http.request(
                    method,
                    url,
                    headers=dict(headers or {}),
                    content=post_data,
                    timeout=max(deadline.left(), 0.001),
                )
        except httpx.TransportError as exc:
            message = f"connection error ({type(exc).__name__})"
            error = stripe.APIConnectionError(message, should_retry=False)  # type: ignore[no-untyped-call]
            raise error from exc
        if downstream is not None:
            said = wire.http_date(response.headers)
            tell_time(self._time_seen, downstream, said, deadline, began)
        return response.content, response.status_code, response.headers

    def close(self) -> None:
        self._http.close()


def _quiet_sdk_console() -> None:
    """Turn off the SDK's own printing: with ``stripe.log`` or ``STRIPE_LOG`` at ``info`` or
    ``debug`` it prints every request's URL and body (amounts, payees) to stderr, past any
    logging configuration. Its logger is silenced by ``outbox.logs``."""
    from stripe import _util

    stripe.log = None
    _util.STRIPE_LOG = None  # read from the environment at import


class StripeGateway:
    """The ``Gateway`` port for refunds over Stripe (kind ``refund``)."""

    def __init__(
        self,
        api_keys: Mapping[str, SecretStr],
        *,
        api_base: str = DEFAULT_API_BASE,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        time_seen: TimeSeen | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._timeout = timeout
        self._http = DeadlineHttpClient(transport, time_seen=time_seen)
        _quiet_sdk_console()
        self._clients = {
            tenant: stripe.StripeClient(
                key.get_secret_value(),
                stripe_version=API_VERSION,
                base_addresses={"api": api_base.rstrip("/")},
                max_network_retries=0,
                http_client=self._http,
            )
            for tenant, key in api_keys.items()
        }

    def close(self) -> None:
        self._http.close()

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Create the refund once; never retries; never spends past ``deadline``."""
        tenant, op_id, idempotency_key = request.tenant, request.op_id, request.idempotency_key
        kind, params = request.kind, request.params
        fields = {"tenant": tenant, "kind": kind.name, "key": idempotency_key}
        client = self._clients.get(tenant)
        if client is None:
            log.warning("submit refused locally: no Stripe key for the tenant", extra=fields)
            return Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0)
        until = self._within(deadline, kind.name)
        if until.left() <= 0:
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        form = {
            "payment_intent": params["order_id"],
            "amount": params["amount_minor"],
            "metadata": {
                TENANT_FIELD: tenant,
                OP_ID_FIELD: op_id,
                KEY_FIELD: idempotency_key,
                PAYEE_FIELD: params["payee"],
            },
        }
        options: stripe.RequestOptions = {
            "idempotency_key": idempotency_key,
            "max_network_retries": 0,
        }
        checked = self._check_intent(client, params)
        if checked is not None:
            log.info("stripe submit refused before sending", extra={**fields, "proof": "not_sent"})
            return checked
        try:
            refund = client.v1.refunds.create(form, options)  # type: ignore[arg-type]
        except stripe.StripeError as exc:
            outcome = answered(classify_error(exc, now=datetime.now(UTC)), exc.request_id)
        else:
            response = refund.last_response
            outcome = classify_refund(refund.to_dict(), params, idempotency_key)
            if isinstance(outcome, Accepted) and response is not None:
                outcome = replace(outcome, status=response.code)
            outcome = answered(outcome, response.request_id if response is not None else None)
        log.info("stripe submit answered", extra={**fields, "proof": outcome.proof.value})
        return outcome

    def _check_intent(
        self, client: stripe.StripeClient, params: Mapping[str, Any]
    ) -> SubmitOutcome | None:
        """The payment intent as Stripe holds it, read before the refund is sent: None where the
        refund may be sent; otherwise why it is not (``classify_intent``). A refund names no
        currency of its own: Stripe refunds in the charge's, so an intent in EUR against a USD
        charge would make a real USD refund. Checked on every send (the first one included):
        a read has no effect, and the refund is never sent unless the intent fits."""
        try:
            intent = client.v1.payment_intents.retrieve(
                params["order_id"], options={"max_network_retries": 0}
            )
        except stripe.StripeError as exc:
            return answered(classify_intent_error(exc, now=datetime.now(UTC)), exc.request_id)
        response = intent.last_response
        refused = classify_intent(intent.to_dict(), params)
        if refused is None:
            return None
        return answered(refused, response.request_id if response is not None else None)

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Find the refund among the payment intent's refunds by the operation in its metadata."""
        tenant, op_id, idempotency_key = request.tenant, request.op_id, request.idempotency_key
        params = request.params
        client = self._clients.get(tenant)
        if client is None:
            return Unavailable("no Stripe key configured for the tenant")
        until = self._within(deadline, request.kind.name)
        if until.left() <= 0:
            return Unavailable("deadline passed before sending")
        query: dict[str, Any] = {"payment_intent": params["order_id"], "limit": LIST_LIMIT}
        while True:
            try:
                page = client.v1.refunds.list(query, {"max_network_retries": 0})  # type: ignore[arg-type]
            except stripe.StripeError as exc:
                if intent_missing(exc):
                    # Stripe knows no such payment intent in this account: no refund of it
                    # exists there, nor can one be made (a refund needs its payment intent;
                    # Stripe deletes none and reuses no id). A "not found", so the reconciler's
                    # rules for one apply (asked after quiescence, inside the key retention,
                    # then sent again with the same key), never a verdict by itself: the next
                    # send reads the intent first and is refused without a refund being sent.
                    log.info(
                        "stripe lookup: no such payment intent",
                        extra={"tenant": tenant, "key": idempotency_key},
                    )
                    return LookupNotFound()
                log.info(
                    "stripe lookup unavailable",
                    extra={"tenant": tenant, "key": idempotency_key, "error": type(exc).__name__},
                )
                return Unavailable(f"listing refunds failed ({type(exc).__name__})")
            listed = page.to_dict()
            found = _find(listed, tenant, op_id, params, idempotency_key)
            if found is not None:
                return found
            if not listed.get("has_more"):
                return LookupNotFound()
            # Not on this page is not "not found": read the next, while the deadline lasts.
            last = _last_id(listed)
            if last is None or last == query.get("starting_after"):
                return Unavailable("the refunds list has more but does not page on")
            if until.left() <= 0:
                return Unavailable("deadline passed before the last page of refunds")
            query["starting_after"] = last

    def effects_since(
        self, tenant: str, since: datetime, /, *, deadline: Deadline | datetime
    ) -> EffectsOutcome:
        """The refunds created at or after ``since`` (``created[gte]``) in the tenant's Stripe
        account whose metadata names a Settled operation of the tenant, page after page while
        ``deadline`` lasts; failed and canceled refunds are no effect and are left out."""
        client = self._clients.get(tenant)
        if client is None:
            return NotListed("no Stripe key configured for the tenant")
        until = self._within(deadline, "refund")
        query: dict[str, Any] = {"created": {"gte": int(since.timestamp())}, "limit": LIST_LIMIT}
        effects: list[Effect] = []
        while True:
            if until.left() <= 0:
                return listed_so_far(effects, "deadline passed before the last page of refunds")
            try:
                page = client.v1.refunds.list(query, {"max_network_retries": 0})  # type: ignore[arg-type]
            except stripe.StripeError as exc:
                return listed_so_far(effects, f"listing refunds failed ({type(exc).__name__})")
            listed = page.to_dict()
            refunds = listed.get("data")
            if not isinstance(refunds, list):
                return listed_so_far(effects, "the refunds list is not readable")
            effects.extend(
                e for e in map(_effect_of, refunds) if e is not None and e.tenant == tenant
            )
            if not listed.get("has_more"):
                return EffectsListed(tuple(effects))
            last = _last_id(listed)
            if last is None or last == query.get("starting_after"):
                return listed_so_far(effects, "the refunds list has more but does not page on")
            query["starting_after"] = last

    def _within(self, deadline: Deadline | datetime, downstream: str) -> Deadline:
        if isinstance(deadline, datetime):  # on this process's wall clock
            deadline = Deadline.from_wall(deadline, datetime.now(UTC))
        until = deadline.capped(self._timeout)
        self._http.within(until, downstream)
        return until


def _find(
    listed: Mapping[str, Any], tenant: str, op_id: str, params: Mapping[str, Any], key: str
) -> LookupOutcome | None:
    """The lookup's answer from one page of a payment intent's refunds: the refund whose
    metadata names the operation (tenant and op id), checked against the intent and the key;
    None where it is not on the page."""
    refunds = listed.get("data")
    if not isinstance(refunds, list):
        return Unavailable("the refunds list is not readable")
    for refund in refunds:
        metadata = refund.get("metadata") if isinstance(refund, dict) else None
        if not isinstance(metadata, dict):
            continue
        if metadata.get(TENANT_FIELD) != tenant or metadata.get(OP_ID_FIELD) != op_id:
            continue
        receipt = receipt_of(refund)
        if receipt is None:
            return Unavailable("the refund is not readable")
        wrong = misfit(receipt, params, key)
        if wrong is not None:
            # Ours but different: what the downstream did, unless it is not settled yet.
            usable = wrong == "receipt_mismatch" and receipt.status != PENDING
            return LookupMisuse(
                wrong, "the refund does not match the intent", receipt if usable else None
            )
        if receipt.status == PENDING:
            # Not made yet and it may still fail: uncertain until Stripe settles it.
            return Unavailable(f"the refund is {refund.get('status')} at Stripe", pending=True)
        if receipt.status == "succeeded":
            return Found(receipt)
        return Found(receipt, RejectReason.BUSINESS_REJECTED, refusal_code(refund))
    return None


def _last_id(listed: Mapping[str, Any]) -> str | None:
    """The id of a page's last refund (the next page starts after it); None if unreadable."""
    refunds = listed.get("data")
    if not isinstance(refunds, list) or not refunds or not isinstance(refunds[-1], dict):
        return None
    last = refunds[-1].get("id")
    return last if isinstance(last, str) else None


#: A refund in these states made no effect (nothing was or will be paid out).
NO_EFFECT = frozenset({"failed", "canceled"})


def _effect_of(refund: object) -> Effect | None:
    """A listed refund as an effect, where its metadata names a Settled operation (tenant and op
    id) and it made or may still make one; None otherwise (not Settled's, or failed)."""
    if not isinstance(refund, dict):
        return None
    metadata = refund.get("metadata")
    if not isinstance(metadata, dict):
        return None
    tenant, op_id, key = (metadata.get(f) for f in (TENANT_FIELD, OP_ID_FIELD, KEY_FIELD))
    reference, status = refund.get("id"), refund.get("status")
    if not isinstance(tenant, str) or not isinstance(op_id, str) or status in NO_EFFECT:
        return None
    if not isinstance(reference, str):
        return None
    amount, currency, created = refund.get("amount"), refund.get("currency"), refund.get("created")
    return Effect(
        downstream="stripe",
        tenant=tenant,
        reference=reference,
        idempotency_key=key if isinstance(key, str) else None,
        op_id=op_id,
        amount_minor=amount if isinstance(amount, int) and not isinstance(amount, bool) else None,
        currency=currency.upper() if isinstance(currency, str) else None,
        status=str(status),
        created=(
            datetime.fromtimestamp(created, UTC)
            if isinstance(created, int) and not isinstance(created, bool)
            else None
        ),
    )
