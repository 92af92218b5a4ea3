"""A typed client of the simulator's control API (test mode only): faults, switches, truth;
and ``order_total``, a ``SETTLED_WECHATPAY_ORDER_TOTALS`` function reading the simulator's
orders (for a worker whose WeChat Pay is the simulator: the demo's, the tests')."""

from __future__ import annotations

import enum
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import httpx

from settled.simulator.faults import Fault
from settled.simulator.state import Switches


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET


class SimulatorControl:
    """Drive a simulator started with ``test_mode=True``; every call raises on an HTTP error."""

    def __init__(
        self, base_url: str, *, timeout: float = 5.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self._client = httpx.Client(
            base_url=base_url.rstrip("/") + "/_control/",
            timeout=timeout,
            transport=transport,
            trust_env=False,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SimulatorControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, route: str, body: Mapping[str, Any] | None = None) -> Any:
        response = self._client.request(method, route, json=body)
        response.raise_for_status()
        return response.json()

    # -- setup --------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything: ledger, tenants, rules, schedule, switches, clock, counters."""
        self._call("POST", "reset")

    def add_tenant(self, tenant: str, api_key: str) -> None:
        """Register (or re-key) a tenant; requests with ``Bearer api_key`` act as it."""
        self._call("POST", "tenants", {"tenant": tenant, "api_key": api_key})

    def create_order(
        self,
        tenant: str,
        order_id: str,
        amount_minor: int,
        currency: str = "CNY",
        *,
        closed: bool = False,
    ) -> None:
        """Create (or replace) a charged order that refunds and tickets refer to."""
        self._call(
            "POST",
            "orders",
            {
                "tenant": tenant,
                "order_id": order_id,
                "amount_minor": amount_minor,
                "currency": currency,
                "status": "closed" if closed else "open",
            },
        )

    def add_alipay_app(self, tenant: str, app_id: str, app_public_key: str) -> None:
        """Register (or re-key) an Alipay app of ``tenant`` with its RSA public key (PEM):
        requests to the Alipay mode signed by its private key act as the tenant."""
        body = {"tenant": tenant, "app_id": app_id, "app_public_key": app_public_key}
        self._call("POST", "alipay_apps", body)

    def alipay_public_key(self) -> str:
        """The Alipay mode's public key (PEM), made at its first use: its answers' signer."""
        return str(self._call("GET", "alipay_keys")["alipay_public_key"])

    # -- faults -------------------------------------------------------------------------

    def add_rule(
        self,
        fault: Fault | str,
        pattern: str = "*",
        *,
        kind: str | None = None,
        tenant: str | None = None,
        times: int | None = None,
        retry_after: str | None = None,
        hold_seconds: float | None = None,
        field: str | None = None,
        code: str | None = None,
    ) -> int:
        """Inject ``fault`` into requests whose key matches the glob ``pattern``; returns its id."""
        body = {
            "fault": Fault(fault).value,
            "pattern": pattern,
            "kind": kind,
            "tenant": tenant,
            "times": times,
            "retry_after": retry_after,
            "hold_seconds": hold_seconds,
            "field": field,
            "code": code,
        }
        return int(self._call("POST", "rules", body)["id"])

    def clear_rules(self) -> None:
        """Remove every rule and the schedule."""
        self._call("DELETE", "rules")

    def set_schedule(
        self,
        seed: int,
        probabilities: Mapping[Fault, float] | Mapping[str, float],
        *,
        kind: str | None = None,
        tenant: str | None = None,
        retry_after: str | None = None,
        hold_seconds: float | None = None,
    ) -> None:
        """Draw faults with ``probabilities``, reproducibly per (seed, key, request number)."""
        body = {
            "seed": seed,
            "probabilities": {Fault(f).value: p for f, p in probabilities.items()},
            "kind": kind,
            "tenant": tenant,
            "retry_after": retry_after,
            "hold_seconds": hold_seconds,
        }
        self._call("POST", "schedule", body)

    def clear_schedule(self) -> None:
        self._call("DELETE", "schedule")

    def faults(self) -> dict[str, Any]:
        """The active rules (with what is left of their ``times``), the schedule, and the
        faults injected so far by name (``injected``)."""
        result: dict[str, Any] = self._call("GET", "faults")
        return result

    def injected(self) -> dict[str, int]:
        """How many times each fault acted on a request since start or the last reset, by
        fault name (a drawn fault with nothing to act on, e.g. ``503_after_commit`` on a
        replay, is not counted)."""
        return {name: int(n) for name, n in self.faults()["injected"].items()}

    def release_holds(self) -> None:
        """End every held request now (a held ``commit_then_timeout`` then answers late)."""
        self._call("POST", "release")

    # -- switches and clock -------------------------------------------------------------

    def set_switches(
        self,
        *,
        idempotency: bool | None = None,
        lookup: bool | None = None,
        key_retention_seconds: float | _Unset | None = UNSET,
        lookup_visibility_delay: float | None = None,
        deadline_fence: bool | None = None,
        effects_list: bool | None = None,
    ) -> Switches:
        """Change the given switches (``key_retention_seconds=None``: never forget keys;
        ``deadline_fence=False``: execute submits that arrive after their deadline)."""
        body: dict[str, Any] = {}
        if idempotency is not None:
            body["idempotency"] = idempotency
        if lookup is not None:
            body["lookup"] = lookup
        if key_retention_seconds is not UNSET:
            body["key_retention_seconds"] = key_retention_seconds
        if lookup_visibility_delay is not None:
            body["lookup_visibility_delay"] = lookup_visibility_delay
        if deadline_fence is not None:
            body["deadline_fence"] = deadline_fence
        if effects_list is not None:
            body["effects_list"] = effects_list
        return Switches(**self._call("POST", "switches", body))

    def switches(self) -> Switches:
        return Switches(**self._call("GET", "switches"))

    def move_stripe_refund(
        self, tenant: str, key: str, status: str, failure_reason: str | None = None
    ) -> None:
        """Move the Stripe mode's refund made for ``key`` (by the ``refund_status`` fault) on
        to ``status``, as Stripe would later: ``pending`` to ``succeeded`` or ``failed``;
        ``requires_action`` to those, ``pending`` or ``canceled``."""
        body = {"tenant": tenant, "key": key, "status": status, "failure_reason": failure_reason}
        self._call("POST", "stripe_refunds", body)

    def advance_clock(self, seconds: float) -> None:
        """Move the simulator's clock (key retention, lookup visibility, the deadline fence and
        the time every answer says); negative ``seconds`` set it back: a downstream behind."""
        self._call("POST", "clock", {"advance_seconds": seconds})

    def add_wechatpay_merchant(
        self,
        tenant: str,
        mchid: str,
        serial_no: str,
        public_key_pem: str,
        *,
        api_v3_key: str | None = None,
    ) -> tuple[str, str]:
        """Register a WeChat Pay merchant of ``tenant`` with the WeChat Pay mode (requests
        signed with the private key of ``public_key_pem`` act as it; ``api_v3_key``, 32
        characters, encrypts its notifications); returns the platform key's id and its public
        key (PEM), which verify the mode's answers."""
        body = {
            "tenant": tenant,
            "mchid": mchid,
            "serial_no": serial_no,
            "public_key": public_key_pem,
        }
        if api_v3_key is not None:
            body["api_v3_key"] = api_v3_key
        answer = self._call("POST", "wechatpay/merchants", body)
        return str(answer["platform_serial"]), str(answer["platform_public_key"])

    def notify_wechatpay(
        self, tenant: str, key: str, url: str, *, timestamp: int | None = None
    ) -> dict[str, Any]:
        """Post WeChat Pay's refund-result notification of refund ``key`` (its
        ``out_refund_no``) to ``url``, encrypted with the merchant's APIv3 key and signed
        (``timestamp``: signed as of then); what was sent and how ``url`` answered."""
        body: dict[str, Any] = {"tenant": tenant, "key": key, "url": url}
        if timestamp is not None:
            body["timestamp"] = timestamp
        answer: dict[str, Any] = self._call("POST", "wechatpay/notify", body)
        return answer

    # -- ground truth -------------------------------------------------------------------

    def ledger(self) -> dict[str, Any]:
        """Effects, orders, tickets, keys in flight and request counts."""
        result: dict[str, Any] = self._call("GET", "ledger")
        return result

    def effects(self, tenant: str, key: str) -> int:
        """How many business effects requests with ``key`` caused (the judge: at most 1)."""
        return sum(
            1
            for e in self.ledger()["effects"]
            if e["tenant"] == tenant and e["idempotency_key"] == key
        )

    def effect_counts(self, tenant: str) -> Counter[str]:
        """``effects`` for every key of ``tenant`` at once, from one read of the ledger: how
        many business effects each idempotency key caused (a key with none is absent)."""
        return Counter(
            e["idempotency_key"] for e in self.ledger()["effects"] if e["tenant"] == tenant
        )

    def refunded(self, tenant: str, order_id: str) -> int:
        """Total refunded on an order, in minor units."""
        for order in self.ledger()["orders"]:
            if order["tenant"] == tenant and order["order_id"] == order_id:
                return int(order["refunded_minor"])
        raise LookupError("no such order")

    def order_total(self, tenant: str, order_id: str) -> int | None:
        """An order's amount in minor units, as the ledger holds it (None: no such order)."""
        for order in self.ledger()["orders"]:
            if (order["tenant"], order["order_id"]) == (tenant, order_id):
                return int(order["amount_minor"])
        return None

    def requests(self, tenant: str, key: str, phase: str = "submit") -> int:
        """How many ``phase`` requests with ``key`` reached the simulator."""
        for row in self.ledger()["requests"]:
            if (row["phase"], row["tenant"], row["idempotency_key"]) == (phase, tenant, key):
                return int(row["count"])
        return 0

    def in_flight(self, tenant: str, key: str) -> bool:
        return {"tenant": tenant, "idempotency_key": key} in self.ledger()["in_flight"]

    def wait_in_flight(self, tenant: str, key: str, timeout: float = 5.0) -> None:
        """Poll until ``key`` is in flight; raise TimeoutError past ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while not self.in_flight(tenant, key):
            if time.monotonic() > end:
                raise TimeoutError("the key never went in flight")
            time.sleep(0.01)


def order_total(tenant: str, order_id: str) -> int | None:
    """A ``SETTLED_WECHATPAY_ORDER_TOTALS`` function (``settled.simulator.control:order_total``)
    for a worker whose WeChat Pay is the simulator: the order's total as the simulator's ledger
    holds it, the simulator found by ``SETTLED_WECHATPAY_API_BASE`` (its URL + ``/wechatpay``)."""
    base = os.environ.get("SETTLED_WECHATPAY_API_BASE", "").removesuffix("/wechatpay")
    if not base:
        raise LookupError("SETTLED_WECHATPAY_API_BASE is not set: no simulator to ask")
    with SimulatorControl(base) as control:
        return control.order_total(tenant, order_id)
