"""The simulator's WeChat Pay mode on the wire: it refuses any request whose signature does not
verify with the merchant's registered key (before anything is counted or executed), signs every
answer it gives with the platform key it made, and keeps WeChat Pay's rules for a refund: one
per ``out_refund_no``, the order's total, CNY only."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from settled.runtime import order_totals_of
from settled.simulator import SimulatorControl, SimulatorHandle
from settled.simulator.control import order_total
from settled.simulator.wechatpay import REFUNDS
from tests.support.simtools import SimTenant
from tests.support.wechatpay import register, rsa_key
from workers.wechatpay_signing import MerchantKeys, answer_unverified, authorization, merchant_keys

ORDER = {"out_trade_no": "A1042", "out_refund_no": "stl_sim_1"}
AMOUNT = {"refund": 10000, "total": 100000, "currency": "CNY"}


@pytest.fixture
def keys(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> MerchantKeys:
    sim_control.create_order(sim_tenant.name, "A1042", 100000)
    return merchant_keys(sim_tenant.name, register(simulator.url, sim_tenant.name))


def _call(
    url: str,
    keys: MerchantKeys,
    method: str,
    path: str,
    body: Any = None,
    *,
    signed_body: bytes | None = None,
    timestamp: int | None = None,
) -> httpx.Response:
    content = b"" if body is None else json.dumps(body).encode()
    header = authorization(
        keys,
        method,
        path,
        content if signed_body is None else signed_body,
        timestamp=int(time.time()) if timestamp is None else timestamp,
        nonce="n0nce",
    )
    return httpx.request(
        method,
        url + path,
        content=content or None,
        headers={"Authorization": header, "Content-Type": "application/json"},
        timeout=5.0,
    )


def _verified(keys: MerchantKeys, answer: httpx.Response) -> Any:
    assert answer_unverified(keys, answer.headers, answer.content, now=time.time()) is None
    return answer.json()


def test_a_refund_is_made_once_per_out_refund_no_and_every_answer_is_signed(
    simulator: SimulatorHandle, sim_control: SimulatorControl, keys: MerchantKeys
) -> None:
    first = _call(simulator.url, keys, "POST", REFUNDS, {**ORDER, "amount": AMOUNT})
    refund = _verified(keys, first)
    assert first.status_code == 200 and refund["status"] == "SUCCESS"
    assert (refund["out_refund_no"], refund["amount"]["refund"]) == ("stl_sim_1", 10000)
    # the same number with another amount: WeChat Pay answers the refund it made, once
    again = _call(
        simulator.url, keys, "POST", REFUNDS, {**ORDER, "amount": {**AMOUNT, "refund": 1}}
    )
    assert _verified(keys, again)["refund_id"] == refund["refund_id"]
    assert _verified(keys, again)["amount"]["refund"] == 10000
    queried = _call(simulator.url, keys, "GET", f"{REFUNDS}/stl_sim_1")
    assert _verified(keys, queried)["refund_id"] == refund["refund_id"]
    assert sim_control.effects("acme", "stl_sim_1") == 1
    missing = _call(simulator.url, keys, "GET", f"{REFUNDS}/stl_never")
    assert missing.status_code == 404
    assert _verified(keys, missing)["code"] == "RESOURCE_NOT_EXISTS"


@pytest.mark.parametrize(
    "change",
    ["another key", "body changed after signing", "an old timestamp", "no authorization"],
)
def test_a_request_whose_signature_does_not_verify_is_refused_and_nothing_is_done(
    simulator: SimulatorHandle, sim_control: SimulatorControl, keys: MerchantKeys, change: str
) -> None:
    body = {**ORDER, "amount": AMOUNT}
    if change == "another key":
        impostor = MerchantKeys(
            keys.mchid, keys.serial_no, keys.platform_serial, rsa_key("impostor"), keys.platform_key
        )
        answer = _call(simulator.url, impostor, "POST", REFUNDS, body)
    elif change == "body changed after signing":
        signed = json.dumps({**ORDER, "amount": {**AMOUNT, "refund": 1}}).encode()
        answer = _call(simulator.url, keys, "POST", REFUNDS, body, signed_body=signed)
    elif change == "an old timestamp":
        answer = _call(simulator.url, keys, "POST", REFUNDS, body, timestamp=int(time.time()) - 600)
    else:
        answer = httpx.post(simulator.url + REFUNDS, json=body, timeout=5.0)
    assert answer.status_code == 401
    assert _verified(keys, answer)["code"] == "SIGN_ERROR"
    assert sim_control.effects("acme", "stl_sim_1") == 0
    assert sim_control.requests("acme", "stl_sim_1") == 0  # refused before it was counted


@pytest.mark.parametrize(
    ("amount", "code"),
    [
        ({**AMOUNT, "currency": "USD"}, "PARAM_ERROR"),
        ({**AMOUNT, "total": 99999}, "PARAM_ERROR"),
        ({**AMOUNT, "refund": 0}, "PARAM_ERROR"),
        ({**AMOUNT, "refund": 100001}, "INVALID_REQUEST"),
    ],
    ids=["not CNY", "another total", "nothing to refund", "over what is left"],
)
def test_a_refund_wechat_pay_would_not_take_is_refused_and_makes_nothing(
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    keys: MerchantKeys,
    amount: Any,
    code: str,
) -> None:
    answer = _call(simulator.url, keys, "POST", REFUNDS, {**ORDER, "amount": amount})
    assert answer.status_code == 400
    assert _verified(keys, answer)["code"] == code
    assert sim_control.effects("acme", "stl_sim_1") == 0
    assert sim_control.refunded("acme", "A1042") == 0


def test_the_simulators_order_totals_function_reads_its_orders(
    simulator: SimulatorHandle, sim_control: SimulatorControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``settled.simulator.control:order_total``, a worker's ``SETTLED_WECHATPAY_ORDER_TOTALS``
    against the simulator: the total of an order it holds, None for one it does not; without
    ``SETTLED_WECHATPAY_API_BASE`` it has no simulator to ask (nothing is sent then)."""
    sim_control.create_order("acme", "A1042", 100000)
    monkeypatch.setenv("SETTLED_WECHATPAY_API_BASE", simulator.url + "/wechatpay")
    assert order_total("acme", "A1042") == 100000
    assert order_total("acme", "A9999") is None
    assert order_total("globex", "A1042") is None
    assert order_totals_of("settled.demo:simulator_order_total") is order_total
    monkeypatch.delenv("SETTLED_WECHATPAY_API_BASE")
    with pytest.raises(LookupError):
        order_total("acme", "A1042")
