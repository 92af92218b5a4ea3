"""The control routes of the simulator's WeChat Pay mode (test mode only), under
``/_control/wechatpay/``: register a merchant (``merchants``), script a create to be taken on as
``PROCESSING`` (``processing``), and end a refund ``PROCESSING`` (``settle``). The typed client
is ``SimulatorControl.add_wechatpay_merchant``; docs/providers.md, "Pointing Settled at WeChat
Pay", shows each route's body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
    except (ValueError, TypeError, KeyError) as exc:
        return wechat_error(400, "PARAM_ERROR", f"bad control request: {exc}")
    return wechat_error(404, "RESOURCE_NOT_EXISTS", "no such control route")


def _add_merchant(mode: WechatPayMode, data: Mapping[str, Any]) -> dict[str, Any]:
    key = serialization.load_pem_public_key(str(data["public_key"]).encode())
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("public_key must be an RSA public key")
    merchant = Merchant(str(data["tenant"]), str(data["mchid"]), str(data["serial_no"]), key)
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
