"""Refunds through Alipay's OpenAPI gateway: the ``Gateway`` port under the same guarantees as
the HTTP gateway (docs/providers.md, "Pointing Settled at Alipay").

Each call is one signed form POST to the gateway (``gateway.do``): the common parameters
(``app_id``, ``method``, ``format``, ``charset``, ``sign_type=RSA2``, ``timestamp``,
``version``), ``biz_content`` (the method's parameters as JSON), and ``sign``: RSA-SHA256
(PKCS #1 v1.5) by the tenant's app private key over every other non-empty parameter, sorted by
name, as ``name=value`` joined by ``&``. An answer is ``{"<method>_response": {...}, "sign":
"..."}``; its ``sign`` is verified with Alipay's public key over the exact text of the
response node, before any of it is read. An answer that does not verify, or carries no
signature, proves nothing: ``Unknown`` (a lookup's: ``Unavailable``), never a success or a
refusal.

Signed here with ``cryptography`` over Settled's own HTTP client (httpx, the bounded transport
of ``workers.transport``), not through an Alipay SDK: exactly one request per call, the whole
request ended by the operation's deadline, its transport errors split by phase (nothing sent
vs maybe sent). The official ``alipay-sdk-python`` makes its own ``http.client`` connection
(no transport to bound, failures told apart only by message text), logs every request with its
parameters and every answer to the logger it is given, and puts the whole answer in its error
texts; ``python-alipay-sdk`` reads with ``urlopen`` (a per-read timeout) and logs the signed
content at debug. Why, in full: docs/providers.md.

A refund is ``alipay.trade.refund`` with the intent's ``order_id`` as ``out_trade_no``, its
amount in yuan as ``refund_amount`` and the stored idempotency key as ``out_request_no``, which
Alipay deduplicates. A lookup never sends again: it is ``alipay.trade.fastpay.refund.query``
by ``out_trade_no`` and ``out_request_no``.

Each answer's ``Date`` (whole seconds) is told to the process's clock watch, as the wire
protocol's time is (``workers.downstream_time``). Not the answer's ``gmt_refund_pay``: that is
when the refund was made (a replay or a query says the first time again), not when the answer
was written.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from pydantic import SecretStr

from outbox import wire
from outbox.clock import Deadline
from outbox.downstream import (
    DownstreamRequest,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.port_shim import old_keywords
from outbox.retry import parse_retry_after
from outbox.states import RejectReason
from workers.alipay_classify import (
    CURRENCY,
    ERROR_NODE,
    QUERY_NODE,
    REFUND_NODE,
    classify_query,
    classify_refund,
    yuan,
)
from workers.downstream_time import TimeSeen, tell_time
from workers.transport import BoundedTransport, bound_request, error_name, not_sent

log = logging.getLogger(__name__)

#: Alipay's production gateway (its sandbox: ``SANDBOX_GATEWAY``).
DEFAULT_GATEWAY = "https://openapi.alipay.com/gateway.do"
SANDBOX_GATEWAY = "https://openapi-sandbox.dl.alipaydev.com/gateway.do"
REFUND = "alipay.trade.refund"
QUERY = "alipay.trade.fastpay.refund.query"
#: Alipay reads the request's ``timestamp`` in Beijing time.
BEIJING = timezone(timedelta(hours=8))


@dataclass(frozen=True)
class AlipayApp:
    """One tenant's Alipay app: its id, its private key (PEM, or the bare base64 of Alipay's
    key tool) and Alipay's public key for it (the same forms). Not in the repr."""

    app_id: str
    private_key: SecretStr = field(repr=False)
    alipay_public_key: str = field(repr=False)


def load_private_key(text: str) -> rsa.RSAPrivateKey:
    """An RSA private key from PEM (PKCS #8 or #1) or bare base64 DER; ValueError otherwise,
    naming no part of it."""
    try:
        if "-----BEGIN" in text:
            key: object = serialization.load_pem_private_key(text.encode(), password=None)
        else:
            key = serialization.load_der_private_key(_der(text), password=None)
    except (ValueError, TypeError, binascii.Error):
        raise ValueError("not a readable RSA private key") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("not an RSA private key")
    return key


def load_public_key(text: str) -> rsa.RSAPublicKey:
    """An RSA public key from PEM or bare base64 DER (SubjectPublicKeyInfo); ValueError
    otherwise."""
    try:
        if "-----BEGIN" in text:
            key: object = serialization.load_pem_public_key(text.encode())
        else:
            key = serialization.load_der_public_key(_der(text))
    except (ValueError, TypeError, binascii.Error):
        raise ValueError("not a readable RSA public key") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    return key


def _der(text: str) -> bytes:
    return base64.b64decode("".join(text.split()), validate=True)


def signing_content(params: Mapping[str, str]) -> str:
    """What a request's ``sign`` is made over: every parameter but ``sign`` that has a value,
    sorted by name, as ``name=value`` joined by ``&`` (the values as they are, not encoded)."""
    return "&".join(f"{k}={params[k]}" for k in sorted(params) if k != "sign" and params[k])


def sign(key: rsa.RSAPrivateKey, content: str) -> str:
    """RSA2: base64 of RSA-SHA256 (PKCS #1 v1.5) over ``content`` in UTF-8."""
    signature = key.sign(content.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())
    return base64.b64encode(signature).decode("ascii")


def verified_node(body: bytes, name: str, key: rsa.RSAPublicKey) -> Mapping[str, Any] | None:
    """The response node ``name`` (or ``error_response``) of an answer, where its ``sign``
    verifies with ``key`` over the node's exact text; None where it does not, or the answer
    is not one."""
    try:
        text = body.decode("utf-8")
        document = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    node_name = name if name in document else ERROR_NODE
    node, signature = document.get(node_name), document.get("sign")
    if not isinstance(node, dict) or not isinstance(signature, str):
        return None
    signed = _node_text(text, node_name)
    if signed is None or json.loads(signed) != node:
        return None  # the text found is not the node that was read: verify nothing else
    try:
        raw = base64.b64decode(signature, validate=True)
        key.verify(raw, signed.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, ValueError, binascii.Error):
        return None
    return node


def _node_text(text: str, name: str) -> str | None:
    """The exact text of the top-level member ``name``'s value (a JSON object)."""
    decoder = json.JSONDecoder()
    at = text.find(f'"{name}"')
    while at >= 0:
        colon = at + len(name) + 2
        while colon < len(text) and text[colon] in " \t\r\n":
            colon += 1
        if colon < len(text) and text[colon] == ":":
            start = colon + 1
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                _, end = decoder.raw_decode(text, start)
            except ValueError:
                return None
            return text[start:end]
        at = text.find(f'"{name}"', at + 1)
    return None


@dataclass(frozen=True)
class _Keys:
    app_id: str
    private: rsa.RSAPrivateKey
    alipay: rsa.RSAPublicKey


class AlipayGateway:
    """The ``Gateway`` port for refunds over Alipay (kind ``refund``)."""

    def __init__(
        self,
        apps: Mapping[str, AlipayApp],
        *,
        gateway_url: str = DEFAULT_GATEWAY,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        time_seen: TimeSeen | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._timeout = timeout
        self._time_seen = time_seen
        self._url = gateway_url
        self._keys: dict[str, _Keys] = {}
        for tenant, app in apps.items():
            try:
                self._keys[tenant] = _Keys(
                    app.app_id,
                    load_private_key(app.private_key.get_secret_value()),
                    load_public_key(app.alipay_public_key),
                )
            except ValueError as exc:
                raise ValueError(f"Alipay app of tenant {tenant!r}: {exc}") from None
        self._http = httpx.Client(
            transport=transport or BoundedTransport(), trust_env=False, follow_redirects=False
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AlipayGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Ask for the refund once; never retries; never spends past ``deadline``."""
        tenant, key, params = request.tenant, request.idempotency_key, request.params
        fields = {"tenant": tenant, "kind": request.kind.name, "key": key}
        keys = self._keys.get(tenant)
        if keys is None:
            log.warning("submit refused locally: no Alipay app for the tenant", extra=fields)
            return Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0)
        if params.get("currency") != CURRENCY:
            return Refused(RejectReason.INVALID_PARAMS, "currency_not_supported", 0)
        until = self._within(deadline)
        if until.left() <= 0:
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        biz = {
            "out_trade_no": params["order_id"],
            "refund_amount": yuan(int(params["amount_minor"])),
            "out_request_no": key,
        }
        answer = self._call(keys, REFUND, biz, until, request.kind.name)
        if isinstance(answer, httpx.Response):
            outcome = self._read_refund(answer, keys, params, key)
        else:
            outcome = answer
        log.info("alipay submit answered", extra={**fields, "proof": outcome.proof.value})
        return outcome

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Query the refund by the order and the refund number (the idempotency key)."""
        tenant, key, params = request.tenant, request.idempotency_key, request.params
        keys = self._keys.get(tenant)
        if keys is None:
            return Unavailable("no Alipay app configured for the tenant")
        until = self._within(deadline)
        if until.left() <= 0:
            return Unavailable("deadline passed before sending")
        biz = {"out_trade_no": params["order_id"], "out_request_no": key}
        answer = self._call(keys, QUERY, biz, until, request.kind.name)
        if not isinstance(answer, httpx.Response):
            return Unavailable(f"the refund query failed ({answer.detail})")
        if answer.status_code != 200:
            return Unavailable(f"the refund query answered HTTP {answer.status_code}")
        node = verified_node(answer.content, QUERY_NODE, keys.alipay)
        if node is None:
            log.warning("alipay query answer not verified", extra={"tenant": tenant, "key": key})
            return Unavailable("the refund query's answer is not signed by Alipay")
        return classify_query(node, params, key)

    def _call(
        self, keys: _Keys, method: str, biz: Mapping[str, str], until: Deadline, downstream: str
    ) -> httpx.Response | NotSent | Unknown:
        """One signed POST of ``method``: the answer (its time told as ``downstream``'s), or
        what a transport failure proves."""
        form = {
            "app_id": keys.app_id,
            "method": method,
            "format": "JSON",
            "charset": "utf-8",
            "sign_type": "RSA2",
            "timestamp": datetime.now(BEIJING).strftime("%Y-%m-%d %H:%M:%S"),
            "version": "1.0",
            "biz_content": json.dumps(biz, separators=(",", ":"), ensure_ascii=False),
        }
        form["sign"] = sign(keys.private, signing_content(form))
        began = until.monotonic()
        try:
            with bound_request(until):
                response = self._http.post(
                    self._url,
                    data=form,
                    headers={"Accept": "application/json"},
                    timeout=max(until.left(), 0.001),
                )
        except httpx.TransportError as exc:
            unsent = not_sent(exc)
            return unsent if unsent is not None else Unknown(error_name(exc))
        tell_time(self._time_seen, downstream, wire.http_date(response.headers), until, began)
        return response

    def _read_refund(
        self, answer: httpx.Response, keys: _Keys, params: Mapping[str, Any], key: str
    ) -> SubmitOutcome:
        """What the gateway's answer to a refund proves."""
        status = answer.status_code
        if status == 429:  # a throttle in front of the gateway: refused before processing
            retry_after = parse_retry_after(answer.headers.get("Retry-After"), datetime.now(UTC))
            return NotExecuted(429, retry_after)
        if status >= 500:
            return Unknown(f"HTTP {status}", status)
        if status != 200:
            return Misuse("unexpected_response", f"unexpected HTTP {status}", status)
        node = verified_node(answer.content, REFUND_NODE, keys.alipay)
        if node is None:
            # Unsigned, tampered or unreadable: it proves neither a refund nor a refusal.
            return Unknown("the answer is not signed by Alipay", status)
        return classify_refund(node, params, key)

    def _within(self, deadline: Deadline | datetime) -> Deadline:
        if isinstance(deadline, datetime):  # on this process's wall clock
            deadline = Deadline.from_wall(deadline, datetime.now(UTC))
        return deadline.capped(self._timeout)
