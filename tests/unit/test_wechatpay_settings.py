"""Refunds through WeChat Pay as configured (``SETTLED_DOWNSTREAM_PROVIDERS``,
``SETTLED_WECHATPAY_MERCHANTS``, ``SETTLED_WECHATPAY_ORDER_TOTALS``): the gateway each kind
goes to, each missing or unreadable setting a clear error naming it, and the merchant's private
key in no repr and no error text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from outbox.errors import InvalidInput
from outbox.kinds import default_registry
from outbox.settings import Settings, settings_error
from outbox.settings_contracts import ContractSettings
from outbox.settings_wechatpay import WechatPayMerchant
from settled.runtime import build_gateway
from tests.support.wechatpay import (
    API_V3_KEY,
    MCHID,
    PLATFORM_SERIAL,
    SERIAL,
    private_pem,
    public_pem,
    rsa_key,
)
from workers.http_client import HttpGateway
from workers.routing import GatewayByKind
from workers.wechatpay_gateway import CONTRACT, WechatPayGateway

REGISTRY = default_registry()
TOTALS = "tests.support.wechatpay:order_total"


def _key_files(tmp_path: Path) -> dict[str, str]:
    private = tmp_path / "apiclient_key.pem"
    private.write_text(private_pem(rsa_key("merchant")))
    platform = tmp_path / "pub_key.pem"
    platform.write_text(public_pem(rsa_key("platform")))
    return {
        "mchid": MCHID,
        "serial_no": SERIAL,
        "private_key_file": str(private),
        "platform_serial": PLATFORM_SERIAL,
        "platform_public_key_file": str(platform),
    }


def test_refunds_go_to_wechat_pay_with_keys_read_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_DOWNSTREAM_PROVIDERS", json.dumps({"refund": "wechatpay"}))
    monkeypatch.setenv("SETTLED_WECHATPAY_MERCHANTS", json.dumps({"acme": _key_files(tmp_path)}))
    monkeypatch.setenv("SETTLED_WECHATPAY_ORDER_TOTALS", TOTALS)
    monkeypatch.setenv("SETTLED_WECHATPAY_API_BASE", "http://127.0.0.1:9/wechatpay")
    gateway = build_gateway(Settings(), REGISTRY)
    try:
        assert isinstance(gateway, GatewayByKind)
        assert isinstance(gateway.of(REGISTRY.get("refund")), WechatPayGateway)
        assert isinstance(gateway.of(REGISTRY.get("pickup")), HttpGateway)
    finally:
        gateway.close()


def test_an_inline_private_key_is_in_no_repr_of_the_settings() -> None:
    pem = private_pem(rsa_key("merchant"))
    merchant = WechatPayMerchant(
        mchid=MCHID,
        serial_no=SERIAL,
        private_key=pem,  # type: ignore[arg-type]
        platform_serial=PLATFORM_SERIAL,
        platform_public_key=public_pem(rsa_key("platform")),
    )
    settings = Settings(wechatpay_merchants={"acme": merchant})
    line = pem.splitlines()[3]
    assert line not in repr(settings) and line not in str(settings.model_dump())


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"wechatpay_merchants": {}}, "SETTLED_WECHATPAY_MERCHANTS"),
        ({"wechatpay_order_totals": None}, "SETTLED_WECHATPAY_ORDER_TOTALS"),
        (
            {"wechatpay_order_totals": "tests.support.wechatpay:no_such"},
            "SETTLED_WECHATPAY_ORDER_TOTALS",
        ),
        ({"wechatpay_order_totals": "no_such_module:f"}, "SETTLED_WECHATPAY_ORDER_TOTALS"),
        ({"wechatpay_order_totals": "not a path"}, "SETTLED_WECHATPAY_ORDER_TOTALS"),
    ],
    ids=["no merchants", "no totals", "no such function", "no such module", "not a path"],
)
def test_each_missing_wechat_pay_setting_is_a_clear_error(
    tmp_path: Path, changes: dict[str, object], setting: str
) -> None:
    values: dict[str, object] = {
        "downstream_providers": {"refund": "wechatpay"},
        "wechatpay_merchants": {"acme": _key_files(tmp_path)},
        "wechatpay_order_totals": TOTALS,
        **changes,
    }
    with pytest.raises(InvalidInput) as caught:
        build_gateway(Settings(**values), REGISTRY)  # type: ignore[arg-type]
    assert caught.value.code == "invalid_setting" and setting in str(caught.value)


def test_an_unreadable_key_is_named_by_its_tenant_and_never_shown(tmp_path: Path) -> None:
    files = _key_files(tmp_path)
    broken = tmp_path / "broken.pem"
    secret = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC-not-a-key"
    broken.write_text(f"-----BEGIN PRIVATE KEY-----\n{secret}\n-----END PRIVATE KEY-----\n")
    settings = Settings(
        downstream_providers={"refund": "wechatpay"},
        wechatpay_merchants={"acme": {**files, "private_key_file": str(broken)}},  # type: ignore[dict-item]
        wechatpay_order_totals=TOTALS,
    )
    with pytest.raises(InvalidInput) as caught:
        build_gateway(settings, REGISTRY)
    text = str(caught.value)
    assert "SETTLED_WECHATPAY_MERCHANTS['acme']" in text and "private key" in text
    assert secret not in text and (caught.value.__cause__ is None)


@pytest.mark.parametrize(
    "sources",
    [
        {},
        {"private_key": "x", "private_key_file": "/k.pem"},
    ],
    ids=["neither", "both"],
)
def test_a_merchant_names_exactly_one_source_for_each_key(sources: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="exactly one of private_key"):
        WechatPayMerchant(
            mchid=MCHID,
            serial_no=SERIAL,
            platform_serial=PLATFORM_SERIAL,
            platform_public_key="pem",
            **sources,  # type: ignore[arg-type]
        )


def test_a_deadline_fence_declared_for_a_kind_wechat_pay_serves_is_refused() -> None:
    """WeChat Pay ignores Settled-Deadline: a contract declaring the fence would trust a "not
    found" while a late request could still land."""
    settings = Settings(
        downstream_providers={"refund": "wechatpay"},
        downstream_contracts={"refund": ContractSettings(enforces_deadline=True)},
    )
    with pytest.raises(InvalidInput, match="served by WeChat Pay"):
        settings.apply_contracts(default_registry())


def test_preflight_reads_every_key_and_the_totals_function_before_a_start(tmp_path: Path) -> None:
    """``settled check`` (and every start) refuses what the gateway could not be built with."""
    from settled.preflight import check_configuration

    files = _key_files(tmp_path)
    good = Settings(
        downstream_providers={"refund": "wechatpay"},
        wechatpay_merchants={"acme": files},  # type: ignore[dict-item]
        wechatpay_order_totals=TOTALS,
    )
    check_configuration(good)
    Path(files["platform_public_key_file"]).write_text("not a key")
    with pytest.raises(InvalidInput, match="platform public key"):
        check_configuration(good)
    Path(files["platform_public_key_file"]).write_text(public_pem(rsa_key("platform")))
    no_base = good.model_copy(update={"wechatpay_api_base": "api.mch.weixin.qq.com"})
    with pytest.raises(InvalidInput, match="SETTLED_WECHATPAY_API_BASE"):
        check_configuration(no_base)


def test_a_child_process_gets_the_inline_private_key_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Settings.as_environment`` (how ``settled run`` and the demo configure their children)
    carries the key, not its mask: a worker given ``**********`` could sign nothing."""
    pem = private_pem(rsa_key("merchant"))
    merchant = WechatPayMerchant(
        mchid=MCHID,
        serial_no=SERIAL,
        private_key=pem,  # type: ignore[arg-type]
        platform_serial=PLATFORM_SERIAL,
        platform_public_key=public_pem(rsa_key("platform")),
    )
    env = Settings(wechatpay_merchants={"acme": merchant}).as_environment()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = Settings().wechatpay_merchants["acme"]
    assert child.private_key_pem() == pem.encode()
    assert child == merchant


def test_the_refund_kind_declares_what_wechat_pay_promises() -> None:
    """Key retention, no deadline fence, the delay bound, the statuses that prove "not
    executed": the refund kind's contract as a deployment with WeChat Pay applies it."""
    settings = Settings(downstream_providers={"refund": "wechatpay"})
    contract = settings.apply_contracts(default_registry()).get("refund").contract
    assert {name: getattr(contract, name) for name in CONTRACT} == CONTRACT


def _with_api_v3_key(key: str) -> WechatPayMerchant:
    return WechatPayMerchant(
        mchid=MCHID,
        serial_no=SERIAL,
        private_key=private_pem(rsa_key("merchant")),  # type: ignore[arg-type]
        platform_serial=PLATFORM_SERIAL,
        platform_public_key=public_pem(rsa_key("platform")),
        api_v3_key=key,  # type: ignore[arg-type]
    )


def test_the_api_v3_key_is_a_secret_that_reaches_a_child_process_as_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    merchant = _with_api_v3_key(API_V3_KEY)
    settings = Settings(wechatpay_merchants={"acme": merchant})
    assert API_V3_KEY not in repr(settings) and API_V3_KEY not in str(settings.model_dump())
    for name, value in settings.as_environment().items():
        monkeypatch.setenv(name, value)
    child = Settings().wechatpay_merchants["acme"]
    assert child.api_v3_key_bytes() == API_V3_KEY.encode() and child == merchant


@pytest.mark.parametrize("key", ["too-short-a-key", API_V3_KEY + "x", "密" * 32])
def test_an_api_v3_key_that_is_not_32_bytes_is_refused_and_never_shown(key: str) -> None:
    """As an operator sees it (``settings_error``): the variable named, the value not."""
    given = {"acme": {**_with_api_v3_key(API_V3_KEY).model_dump(), "api_v3_key": key}}
    given["acme"]["private_key"] = private_pem(rsa_key("merchant"))
    with pytest.raises(ValidationError) as refused:
        Settings(wechatpay_merchants=given)
    said = settings_error(refused.value)
    assert "SETTLED_WECHATPAY_MERCHANTS[acme]: api_v3_key must be 32 ASCII characters" in said
    assert key not in said
