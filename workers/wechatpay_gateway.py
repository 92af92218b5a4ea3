"""Refunds through WeChat Pay API v3: the ``Gateway`` port under the same guarantees as the
HTTP gateway (docs/providers.md, "Pointing Settled at WeChat Pay").

Requests are signed here with ``cryptography`` and sent with httpx over the bounded transport
(``workers.transport``), not through the ``wechatpayv3`` SDK: that SDK sends with ``requests``
and one float timeout (per read: no bound on the whole request, and connection errors not split
into "nothing sent" and "maybe sent"), verifies the signature of 2xx answers only (a forged 4xx
refusal would be believed), fetches platform certificates in the middle of a call when a serial
is new (a second request per send), and its logger writes request headers and bodies.

One request per call: a refund is created (``POST /v3/refund/domestic/refunds``) with the
stored idempotency key as ``out_refund_no``, the refund intent's ``order_id`` as
``out_trade_no`` and ``amount`` ``{refund, total, currency: CNY}``; WeChat Pay makes at most one
refund per ``out_refund_no``. A lookup never sends again: it queries the refund by its number
(``GET /v3/refund/domestic/refunds/{out_refund_no}``). Every answer, refusals included, is read
only once its signature verifies with the tenant's platform public key; one that does not
proves nothing (``Unknown``; a lookup's: ``Unavailable``).

WeChat Pay needs the order's total (``amount.total``), which a refund intent does not carry:
the gateway asks ``order_totals(tenant, order_id)`` (the app's function, named by
``SETTLED_WECHATPAY_ORDER_TOTALS``) before it sends.

Each verified answer's signed ``Wechatpay-Timestamp`` (whole seconds) is told to the process's
clock watch, as the wire protocol's time is (``workers.downstream_time``); an answer that does
not verify says nothing of WeChat Pay's clock.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from outbox.clock import Deadline
from outbox.downstream import (
    DownstreamRequest,
    LookupOutcome,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.port_shim import old_keywords
from outbox.provider_contracts import WECHATPAY
from outbox.states import RejectReason
from workers.downstream_time import TimeSeen, tell_time
from workers.transport import BoundedTransport, bound_request, error_name, not_sent
from workers.wechatpay_classify import (
    CURRENCY,
    classify_error,
    classify_lookup,
    classify_refund,
)
from workers.wechatpay_signing import (
    MerchantKeys,
    answer_time,
    answer_unverified,
    authorization,
)

log = logging.getLogger(__name__)

#: WeChat Pay's API (its main domain; ``https://api2.mch.weixin.qq.com`` is the backup).
DEFAULT_API_BASE = "https://api.mch.weixin.qq.com"
REFUNDS_PATH = "/v3/refund/domestic/refunds"
USER_AGENT = "settled-wechatpay"
#: The order's total in fen, by (tenant, order id); None where the order is not known.
OrderTotals = Callable[[str, str], int | None]
#: What WeChat Pay promises for refunds (``outbox.provider_contracts.WECHATPAY``), the
#: contract a kind it serves starts from.
CONTRACT = WECHATPAY


class WechatPayGateway:
    """The ``Gateway`` port for refunds over WeChat Pay API v3 (kind ``refund``)."""

    def __init__(
        self,
        merchants: Mapping[str, MerchantKeys],
        *,
        order_totals: OrderTotals,
        api_base: str = DEFAULT_API_BASE,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        time_seen: TimeSeen | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._merchants = dict(merchants)
        self._order_totals = order_totals
        self._base = api_base.rstrip("/")
        self._timeout = timeout
        self._clock = clock
        self._time_seen = time_seen
        self._http = httpx.Client(
            transport=transport or BoundedTransport(), trust_env=False, follow_redirects=False
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WechatPayGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Create the refund once; never retries; never spends past ``deadline``."""
        tenant, key, params = request.tenant, request.idempotency_key, request.params
        fields = {"tenant": tenant, "kind": request.kind.name, "key": key}
        keys = self._merchants.get(tenant)
        if keys is None:
            log.warning(
                "submit refused locally: no WeChat Pay merchant for the tenant", extra=fields
            )
            return Refused(RejectReason.PERMISSION_DENIED, "no_merchant_key", 0)
        if params["currency"] != CURRENCY:
            # Domestic refunds are made in CNY only: another currency is never sent.
            return Refused(RejectReason.INVALID_PARAMS, "currency_not_cny", 0)
        until = self._within(deadline)
        if until.left() <= 0:
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        try:
            total = self._order_totals(tenant, str(params["order_id"]))
        except Exception as exc:  # the app's function: nothing was sent either way
            log.warning(
                "submit not sent: the order's total could not be read",
                extra={**fields, "error": type(exc).__name__},
            )
            return NotSent(f"order total unavailable ({type(exc).__name__})", SendPhase.BEFORE)
        if total is None:
            return Refused(RejectReason.INVALID_PARAMS, "order_total_unknown", 0)
        body = {
            "out_trade_no": params["order_id"],
            "out_refund_no": key,
            "amount": {"refund": params["amount_minor"], "total": total, "currency": CURRENCY},
        }
        content = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        url = self._base + REFUNDS_PATH
        answer = self._send(keys, "POST", url, content, until, request.kind.name)
        if not isinstance(answer, tuple):
            outcome: SubmitOutcome = answer
        else:
            status, headers, data = answer
            if 200 <= status < 300:
                outcome = classify_refund(data, params, key)
            else:
                outcome = classify_error(status, data, headers, now=datetime.now(UTC))
        log.info("wechatpay submit answered", extra={**fields, "proof": outcome.proof.value})
        return outcome

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Query the refund by its ``out_refund_no`` (the stored key)."""
        tenant, key = request.tenant, request.idempotency_key
        keys = self._merchants.get(tenant)
        if keys is None:
            return Unavailable("no WeChat Pay merchant configured for the tenant")
        until = self._within(deadline)
        if until.left() <= 0:
            return Unavailable("deadline passed before sending")
        url = f"{self._base}{REFUNDS_PATH}/{quote(key, safe='')}"
        answer = self._send(keys, "GET", url, b"", until, request.kind.name)
        if not isinstance(answer, tuple):
            log.info(
                "wechatpay lookup unavailable",
                extra={"tenant": tenant, "key": key, "proof": answer.proof.value},
            )
            return Unavailable(f"the query was not answered ({answer.detail})")
        status, _, data = answer
        return classify_lookup(status, data, request.params, key)

    def _send(
        self,
        keys: MerchantKeys,
        method: str,
        url: str,
        content: bytes,
        until: Deadline,
        downstream: str,
    ) -> tuple[int, Mapping[str, str], Any] | NotSent | Unknown:
        """One signed request and its verified answer (status, header fields, JSON body), or
        what its failure proves: ``NotSent`` where nothing left, ``Unknown`` where it may have
        (the answer lost, cut, unsigned, or not WeChat Pay's). A verified answer's time is
        told as ``downstream``'s."""
        split = urlsplit(url)
        signed_url = split.path + (f"?{split.query}" if split.query else "")
        headers = {
            "Authorization": authorization(
                keys,
                method,
                signed_url,
                content,
                timestamp=int(self._clock()),
                nonce=secrets.token_hex(16),
            ),
            "Accept": "application/json",
            "Wechatpay-Serial": keys.platform_serial,
            "User-Agent": USER_AGENT,
        }
        if content:
            headers["Content-Type"] = "application/json"
        began = until.monotonic()
        try:
            # The float is httpx's per-phase timeout (what is left now); the bound ends the
            # whole request, the answer's every byte included.
            with bound_request(until):
                response = self._http.request(
                    method,
                    url,
                    headers=headers,
                    content=content or None,
                    timeout=max(until.left(), 0.001),
                )
        except httpx.TransportError as exc:
            unsent = not_sent(exc)
            return unsent if unsent is not None else Unknown(error_name(exc))
        raw = response.content
        why = answer_unverified(keys, response.headers, raw, now=self._clock())
        if why is not None:
            # Not proven WeChat Pay's: whatever it says, the request may have been carried out.
            log.warning(
                "wechatpay answer refused: its signature does not verify",
                extra={"status": response.status_code, "reason": why},
            )
            return Unknown(f"the answer's signature does not verify ({why})", response.status_code)
        tell_time(self._time_seen, downstream, answer_time(response.headers), until, began)
        try:
            data = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            return Unknown("the answer is not JSON", response.status_code)
        return response.status_code, response.headers, data

    def _within(self, deadline: Deadline | datetime) -> Deadline:
        if isinstance(deadline, datetime):  # on this process's wall clock
            deadline = Deadline.from_wall(deadline, datetime.now(UTC))
        return deadline.capped(self._timeout)
