"""Refunds through Alipay by configuration: the gateway chosen per kind, each tenant's app
checked whole before a start (no key text in any refusal), the keys secret, and Alipay's
contract applied to the kinds it serves."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox.errors import InvalidInput
from outbox.kinds import default_registry
from outbox.settings import Settings
from outbox.settings_contracts import ContractSettings
from settled.runtime import build_gateway
from tests.support.alipay import app_key, private_pem, public_pem
from workers.alipay_gateway import AlipayGateway
from workers.http_client import HttpGateway
from workers.routing import GatewayByKind

REGISTRY = default_registry()
PRIVATE = private_pem(app_key())
PUBLIC = public_pem(app_key("alipay").public_key())
BROKEN = PRIVATE.replace("A", "*")


def alipay_settings(**changes: object) -> Settings:
    values: dict[str, object] = {
        "downstream_providers": {"refund": "alipay"},
        "alipay_app_ids": {"acme": "2021000000000001"},
        "alipay_private_keys": {"acme": PRIVATE},
        "alipay_public_keys": {"acme": PUBLIC},
        "alipay_gateway_url": "http://127.0.0.1:9/alipay/gateway.do",
    }
    return Settings(**{**values, **changes})  # type: ignore[arg-type]


def test_refunds_can_go_to_alipay_while_other_kinds_stay_on_the_wire_protocol() -> None:
    settings = alipay_settings()
    gateway = build_gateway(settings, REGISTRY)
    assert isinstance(gateway, GatewayByKind)
    assert isinstance(gateway.of(REGISTRY.get("refund")), AlipayGateway)
    assert isinstance(gateway.of(REGISTRY.get("pickup")), HttpGateway)
    gateway.close()
    assert PRIVATE[40:80] not in repr(settings) and PRIVATE[40:80] not in str(settings)


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"alipay_app_ids": {}}, "SETTLED_ALIPAY_APP_IDS"),
        ({"alipay_private_keys": {}}, "SETTLED_ALIPAY_PRIVATE_KEYS"),
        ({"alipay_public_keys": {"other": PUBLIC}}, "SETTLED_ALIPAY_PUBLIC_KEYS"),
        ({"alipay_private_keys": {"acme": BROKEN}}, "SETTLED_ALIPAY_PRIVATE_KEYS"),
        ({"alipay_private_keys": {"acme": PUBLIC}}, "SETTLED_ALIPAY_PRIVATE_KEYS"),
        ({"alipay_public_keys": {"acme": "not a key"}}, "SETTLED_ALIPAY_PUBLIC_KEYS"),
    ],
)  # fmt: skip
def test_an_incomplete_or_unreadable_app_is_a_setting_error_naming_no_key(
    changes: dict[str, object], setting: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        build_gateway(alipay_settings(**changes), REGISTRY)
    assert caught.value.code == "invalid_setting"
    assert setting in str(caught.value)
    for secret in (PRIVATE, BROKEN):
        assert secret[40:80] not in str(caught.value)


def test_alipays_contract_is_what_a_refund_it_serves_starts_from() -> None:
    contract = alipay_settings().apply_contracts(default_registry()).get("refund").contract
    assert contract.processing_time == timedelta(seconds=30)
    assert contract.key_retention == timedelta(hours=24)
    assert not contract.enforces_deadline and contract.rests_on == "delay_bound"
    assert contract.not_executed_statuses == frozenset({429})
    # the wire protocol's refunds keep the kind's own
    wire = Settings().apply_contracts(default_registry()).get("refund").contract
    assert wire.processing_time == timedelta(seconds=2)


def test_a_configured_contract_still_wins_over_alipays() -> None:
    settings = alipay_settings(downstream_contracts={"refund": {"processing_seconds": 90}})
    contract = settings.apply_contracts(default_registry()).get("refund").contract
    assert contract.processing_time == timedelta(seconds=90)


def test_a_deadline_fence_cannot_be_declared_for_alipay() -> None:
    settings = alipay_settings(
        downstream_contracts={"refund": ContractSettings(enforces_deadline=True)}
    )
    with pytest.raises(InvalidInput) as caught:
        settings.apply_contracts(default_registry())
    assert "Alipay" in str(caught.value) and "refund" in str(caught.value)


def test_the_keys_reach_a_child_process_environment() -> None:
    env = alipay_settings().as_environment()
    assert PRIVATE.splitlines()[1] in env["SETTLED_ALIPAY_PRIVATE_KEYS"]
    assert env["SETTLED_DOWNSTREAM_PROVIDERS"] == '{"refund": "alipay"}'
