"""What each downstream provider promises, declared once: the contract a kind served by it
starts from (``SETTLED_DOWNSTREAM_CONTRACTS`` still changes it per deployment), applied by
``outbox.settings_contracts.apply_contracts``. A provider not named here keeps the kind's own
contract (the wire protocol's and Stripe's are the kinds' defaults: docs/providers.md).

``UNFENCED``: the providers that ignore ``Settled-Deadline``; a contract declaring the fence for
a kind one of them serves is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

#: Alipay (``alipay.trade.refund``): ``out_request_no`` is deduplicated for the trade's life,
#: a window Alipay does not state, so Settled assumes the 24 hours it assumes of Stripe (the
#: shorter assumption is the safe one: resends stop sooner, never later); no deadline fence
#: (nothing in the OpenAPI refuses a late refund), so a "not found" waits out the delay bound;
#: a refund Alipay makes asynchronously shows in the refund query only once it is made,
#: so a query's empty answer is trusted only 30 s after the attempt (processing time) plus
#: the delay bound; only HTTP 429 proves "refused before processing".
ALIPAY: Mapping[str, Any] = {
    "key_retention": timedelta(hours=24),
    "enforces_deadline": False,
    "max_request_delay": timedelta(minutes=5),
    "processing_time": timedelta(seconds=30),
    "not_executed_statuses": frozenset({429}),
}

#: WeChat Pay API v3 refunds: an ``out_refund_no`` makes one refund and is queryable,
#: trusted for 24 hours (WeChat Pay keeps it longer; Settled relies on no more); WeChat Pay
#: ignores ``Settled-Deadline`` (no fence), so a "not found" waits out the 5-minute delay bound;
#: only ``429 FREQUENCY_LIMITED`` proves "not executed" (``SYSTEM_ERROR`` may have been).
WECHATPAY: Mapping[str, Any] = {
    "idempotent": True,
    "queryable": True,
    "key_retention": timedelta(hours=24),
    "enforces_deadline": False,
    "max_request_delay": timedelta(minutes=5),
    "not_executed_statuses": frozenset({429}),
}

PROVIDER_CONTRACTS: Mapping[str, Mapping[str, Any]] = {"alipay": ALIPAY, "wechatpay": WECHATPAY}

#: the providers that ignore ``Settled-Deadline``, by their names in messages
UNFENCED: Mapping[str, str] = {"stripe": "Stripe", "wechatpay": "WeChat Pay", "alipay": "Alipay"}
