"""Which gateway serves each kind (``SETTLED_DOWNSTREAM_PROVIDERS``), the same for the worker, the
console and ``settled review``, and the Stripe settings kept secret."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outbox.db import upgrade
from outbox.downstream import Gateway
from outbox.errors import InvalidInput
from outbox.kinds import KindRegistry, default_registry
from outbox.settings import Settings
from settled.cli.common import runtime as cli_runtime
from settled.runtime import build_gateway, build_runtime
from settled.web import create_web_app
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


def routes(gateway: Gateway, registry: KindRegistry) -> dict[str, str]:
    """The class of gateway each kind's calls go to."""
    return {
        name: type(
            gateway.of(registry.get(name)) if isinstance(gateway, GatewayByKind) else gateway
        ).__name__
        for name in registry.names()
    }


def test_the_console_and_settled_review_ask_each_kind_where_the_worker_sends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refunds at Stripe: the review queue of ``settled web`` (built from the settings), of the
    console over a runtime and of ``settled review`` route every kind as the worker's executor
    does (a console built with a plain wire-protocol gateway asked the wrong service)."""
    env = {
        "SETTLED_DATABASE_URL": f"sqlite:///{tmp_path / 'settled.sqlite3'}",
        "SETTLED_DOWNSTREAM_PROVIDERS": json.dumps({"refund": "stripe"}),
        "SETTLED_STRIPE_API_KEYS": json.dumps({"acme": "sk_test_secret_value"}),
        "SETTLED_STRIPE_API_BASE": "http://127.0.0.1:9/stripe",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    upgrade(env["SETTLED_DATABASE_URL"])  # ``settled review`` checks it is migrated
    worker = build_runtime(Settings())  # as a Celery worker builds it (settled.celery_app)
    cli = cli_runtime()  # as ``settled review`` builds it
    web = create_web_app(Settings())  # as ``settled web`` builds it
    over_runtime = create_web_app(worker)
    try:
        expected = routes(worker.executor.gateway, REGISTRY)
        assert expected["refund"] == "StripeGateway" and expected["pickup"] == "HttpGateway"
        assert routes(cli.review.gateway, REGISTRY) == expected
        assert routes(web.state.console.review.gateway, REGISTRY) == expected
        assert over_runtime.state.console.review.gateway is worker.executor.gateway
        assert worker.review.gateway is worker.executor.gateway is worker.reconciler.gateway
        # the other services too: one of each per process, sharing what they must share
        console = over_runtime.state.console
        assert console.review is worker.review
        assert console.approvals.proposals is worker.proposals
        assert console.finder is worker.finder and console.overview is worker.overview
        assert worker.agent_desk(tenant=None).proposals is worker.proposals
        assert over_runtime.state.wechatpay_notifications is worker.wechatpay_notifications
        assert worker.proposals.outbox is worker.outbox
        assert worker.executor.fingerprinter is worker.outbox.fingerprinter
        watch = worker.executor.clock_watch
        assert worker.reconciler.clock_watch is watch and worker.review.clock_watch is watch
        assert worker.executor.sessions is worker.reconciler.sessions is worker.sessions
    finally:
        web.state.console.review.gateway.close()
        cli.close()
        worker.close()
