"""Which gateway serves each kind (``SETTLED_DOWNSTREAM_PROVIDERS``), and the Stripe settings
kept secret."""

from __future__ import annotations

import pytest

from outbox.errors import InvalidInput
from outbox.kinds import default_registry
from outbox.settings import Settings
from settled.runtime import build_gateway
from workers.http_client import HttpGateway
from workers.routing import GatewayByKind
from workers.stripe_gateway import StripeGateway

REGISTRY = default_registry()


def test_without_providers_every_kind_goes_to_the_wire_protocol() -> None:
    gateway = build_gateway(Settings(), REGISTRY)
    assert isinstance(gateway, HttpGateway)
    gateway.close()


def test_refunds_can_go_to_stripe_while_other_kinds_stay_on_the_wire_protocol() -> None:
    settings = Settings(
        downstream_providers={"refund": "stripe"},
        stripe_api_keys={"acme": "sk_test_secret_value"},
        stripe_api_base="http://127.0.0.1:9/stripe",
    )
    gateway = build_gateway(settings, REGISTRY)
    assert isinstance(gateway, GatewayByKind)
    assert isinstance(gateway.of(REGISTRY.get("refund")), StripeGateway)
    assert isinstance(gateway.of(REGISTRY.get("pickup")), HttpGateway)
    gateway.close()
    assert "sk_test_secret_value" not in repr(settings)


@pytest.mark.parametrize(
    "providers", [{"pickup": "stripe"}, {"no_such_kind": "http"}], ids=["unservable", "unknown"]
)
def test_a_kind_its_provider_cannot_serve_is_a_clear_setting_error(
    providers: dict[str, str],
) -> None:
    settings = Settings(downstream_providers=providers)
    with pytest.raises(InvalidInput) as caught:
        build_gateway(settings, REGISTRY)
    assert caught.value.code == "invalid_setting"
    assert "SETTLED_DOWNSTREAM_PROVIDERS" in str(caught.value)


def test_an_unknown_provider_is_refused_when_the_settings_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SETTLED_DOWNSTREAM_PROVIDERS", '{"refund": "paypal"}')
    with pytest.raises(ValueError, match="downstream_providers"):
        Settings()
