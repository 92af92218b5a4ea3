"""The control routes of the simulator's WeChat Pay mode (test mode only), under
``/_control/wechatpay/``: register a merchant (``merchants``), script a create to be taken on as
``PROCESSING`` (``processing``), end a refund ``PROCESSING`` (``settle``), and post a settled
refund's result notification to the merchant's ``notify_url`` (``notify``,
``wechatpay_notify``). The typed client
is ``SimulatorControl.add_wechatpay_merchant``; docs/providers.md, "Pointing Settled at WeChat
Pay", shows each route's body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from settled.simulator.ledger import Scripted
from settled.simulator.messages import Response, parse_json
from settled.simulator.state import Simulator
from settled.simulator.wechatpay import (
    FINAL_STATUSES,
    REFUND,
    Merchant,
    WechatPayMode,
    wechat_error,
)
from settled.simulator.wechatpay_notify import merchant_of, notification, refund_of

#: This mode's control routes, under ``/_control/``.
PREFIX = "wechatpay/"


def control(mode: WechatPayMode, sim: Simulator, method: str, route: str, raw: bytes) -> Response:
    """``/_control/wechatpay/...``: register a merchant, script and settle ``PROCESSING``."""
    try:
        data = parse_json(raw) if raw else {}
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        if method == "POST" and route == "merchants":
            return Response(200, _add_merchant(mode, data), {})
        if method == "POST" and route == "processing":
            pattern = str(data.get("pattern", "*"))
            times = int(data.get("times", 1))
            with mode.lock:
                mode.processing.append([str(data["tenant"]), pattern, max(1, times)])
            return Response(200, {"ok": True}, {})
        if method == "POST" and route == "settle":
            return Response(200, _settle(mode, sim, data), {})
        if method == "POST" and route == "notify":
            return Response(200, _notify(mode, sim, data), {})
    except (ValueError, TypeError, KeyError, httpx.HTTPError) as exc:
        return wechat_error(400, "PARAM_ERROR", f"bad control request: {exc}")
    return wechat_error(404, "RESOURCE_NOT_EXISTS", "no such control route")


def _add_merchant(mode: WechatPayMode, data: Mapping[str, Any]) -> dict[str, Any]:
    key = serialization.load_pem_public_key(str(data["public_key"]).encode())
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("public_key must be an RSA public key")
    api_v3_key = data.get("api_v3_key")
    if api_v3_key is not None and len(str(api_v3_key).encode()) != 32:
        raise ValueError("api_v3_key must be 32 bytes")
    merchant = Merchant(
        str(data["tenant"]),
        str(data["mchid"]),
        str(data["serial_no"]),
        key,
        None if api_v3_key is None else str(api_v3_key).encode(),
    )
    with mode.lock:
        mode.merchants[merchant.mchid] = merchant
    return {
        "platform_serial": mode.platform_serial,
        "platform_public_key": mode.platform_public_pem(),
    }


def _settle(mode: WechatPayMode, sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    tenant, key, status = str(data["tenant"]), str(data["key"]), str(data["status"])
    if status not in FINAL_STATUSES:
        raise ValueError(f"status must be one of {FINAL_STATUSES}")
    with mode.lock:
        pending = mode.pending.pop((tenant, key), None)
    if pending is None:
        raise KeyError(f"no refund PROCESSING with out_refund_no {key}")
    code = {"CLOSED": "refund_closed", "ABNORMAL": "refund_abnormal"}.get(status)
    sim.ledger.begin(tenant, key, pending.fingerprint, sim.now())
    execution = sim.ledger.execute(
        tenant=tenant,
        kind=REFUND.name,
        key=key,
        fingerprint=pending.fingerprint,
        params=pending.params,
        now=sim.now(),
        scripted=Scripted(refusal_code=code),
    )
    return {"ok": True, "refund_id": execution.outcome.get("id")}


def _notify(mode: WechatPayMode, sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    """Post the notification of refund ``key`` to ``url``: what was sent, what came back."""
    tenant, key, url = str(data["tenant"]), str(data["key"]), str(data["url"])
    stamp = data.get("timestamp")
    headers, body = notification(
        mode,
        merchant_of(mode, tenant),
        refund_of(sim, tenant, key),
        timestamp=None if stamp is None else int(stamp),
    )
    answer = httpx.post(url, headers=headers, content=body, timeout=10.0, trust_env=False)
    return {
        "sent": {"headers": headers, "body": body.decode()},
        "answer": {"status": answer.status_code, "body": answer.text},
    }
