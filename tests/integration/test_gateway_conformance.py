"""Every ``Gateway`` Settled ships answers the conformance suite (``outbox.conformance``) the
same way: ``FakeGateway`` in memory, ``HttpGateway`` against the simulator's wire protocol,
``StripeGateway`` against its Stripe mode, ``WechatPayGateway`` against its WeChat Pay mode and
``AlipayGateway`` against its Alipay mode, each through a ``FaultProxy``. An adapter added later
gets a class here; a user's adapter a class in the user's tests, as docs/gateway-conformance.md
shows (its examples are run here as written).
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outbox.conformance import FakeDownstream, GatewayConformance, Subject
from outbox.downstream import DownstreamRequest
from outbox.kinds import default_registry
from outbox.testing import FakeGateway
from settled.simulator import SimulatorControl, SimulatorHandle
from settled.simulator.conformance import SimulatorDownstream
from settled.simulator.proxy import FaultProxy
from tests.support.alipay import gateway_url, register_app
from tests.support.simtools import CLIENT_TIMEOUT, SimTenant
from tests.support.wechatpay import register
from workers.alipay_gateway import AlipayGateway
from workers.http_client import HttpGateway
from workers.stripe_gateway import LIST_LIMIT, StripeGateway
from workers.wechatpay_gateway import WechatPayGateway
from workers.wechatpay_signing import merchant_keys

REFUND = default_registry().get("refund")
ORDER = "pi_conformance"
GUIDE = Path(__file__).parents[2] / "docs" / "gateway-conformance.md"


def refunds(tenant: str) -> Callable[[str], DownstreamRequest]:
    """Refund requests of one order, each its own operation: ``request(key)``."""
    numbers = itertools.count(1)

    def request(key: str) -> DownstreamRequest:
        params = {"order_id": ORDER, "amount_minor": 100, "currency": "CNY", "payee": "P-7"}
        return DownstreamRequest(tenant, f"op-{next(numbers)}-{key}", REFUND, key, params)

    return request


class TestFakeGateway(GatewayConformance):
    scripts_references = True

    @pytest.fixture
    def gateway_subject(self) -> Subject:
        fake = FakeGateway()
        return Subject(fake, FakeDownstream(fake), refunds("acme"))


@pytest.fixture
def sim_order(sim_control: SimulatorControl, sim_tenant: SimTenant) -> str:
    sim_control.create_order(sim_tenant.name, ORDER, 10_000_000)
    return ORDER


class TestHttpGateway(GatewayConformance):
    @pytest.fixture
    def gateway_subject(
        self,
        sim_control: SimulatorControl,
        sim_proxy: FaultProxy,
        sim_tenant: SimTenant,
        sim_order: str,
    ) -> Iterator[Subject]:
        keys = {sim_tenant.name: sim_tenant.api_key}
        with HttpGateway(sim_proxy.url, keys, timeout=CLIENT_TIMEOUT) as gateway:
            downstream = SimulatorDownstream(sim_control, sim_proxy)
            yield Subject(gateway, downstream, refunds(sim_tenant.name))


class TestStripeGateway(GatewayConformance):
    pages = LIST_LIMIT
    keeps_refusals = False  # a refused refund is no refund: nothing to list

    @pytest.fixture
    def gateway_subject(
        self,
        sim_control: SimulatorControl,
        sim_proxy: FaultProxy,
        sim_tenant: SimTenant,
        sim_order: str,
    ) -> Iterator[Subject]:
        gateway = StripeGateway(
            {sim_tenant.name: sim_tenant.api_key},
            api_base=sim_proxy.url + "/stripe",
            timeout=CLIENT_TIMEOUT,
        )
        try:
            downstream = SimulatorDownstream(sim_control, sim_proxy)
            yield Subject(gateway, downstream, refunds(sim_tenant.name))
        finally:
            gateway.close()


class TestWechatPayGateway(GatewayConformance):
    keeps_refusals = False  # a refused refund is no refund: the query finds none

    @pytest.fixture
    def gateway_subject(
        self,
        simulator: SimulatorHandle,
        sim_control: SimulatorControl,
        sim_proxy: FaultProxy,
        sim_tenant: SimTenant,
        sim_order: str,
    ) -> Iterator[Subject]:
        merchant = register(simulator.url, sim_tenant.name)
        totals = {sim_order: 10_000_000}
        gateway = WechatPayGateway(
            {sim_tenant.name: merchant_keys(sim_tenant.name, merchant)},
            order_totals=lambda tenant, order: totals.get(order),
            api_base=sim_proxy.url + "/wechatpay",
            timeout=CLIENT_TIMEOUT,
        )
        with gateway:
            # WeChat Pay's own business refusal (the balance short), as its mode answers it
            downstream = SimulatorDownstream(sim_control, sim_proxy, business_code="NOT_ENOUGH")
            yield Subject(gateway, downstream, refunds(sim_tenant.name))


def questions(suite: type[GatewayConformance]) -> int:
    return len([name for name in dir(suite) if name.startswith("test_")])


@pytest.mark.parametrize(
    ("example", "suite"),
    [("conformance-fake", TestFakeGateway), ("conformance-simulator", TestHttpGateway)],
)
def test_the_documented_way_runs_the_suite_against_an_adapter_of_ones_own(
    example: str, suite: type[GatewayConformance], tmp_path: Path
) -> None:
    """docs/gateway-conformance.md's test modules, run by pytest as a user's would be (outside
    this project: none of its configuration or fixtures)."""
    found = re.search(rf"<!-- example: {example} -->\n```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert found, f"docs/gateway-conformance.md has no example {example!r}"
    (tmp_path / "test_mine.py").write_text(found.group(1))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{questions(suite)} passed" in result.stdout, result.stdout


class TestAlipayGateway(GatewayConformance):
    keeps_refusals = False  # a refused refund is no refund: the query shows nothing
    replays_prove = False  # a repeat answers fund_change N: the query settles it

    @pytest.fixture
    def gateway_subject(
        self,
        sim_control: SimulatorControl,
        sim_proxy: FaultProxy,
        sim_tenant: SimTenant,
        sim_order: str,
    ) -> Iterator[Subject]:
        app = register_app(sim_control, sim_tenant.name)
        gateway = AlipayGateway(
            {sim_tenant.name: app}, gateway_url=gateway_url(sim_proxy.url), timeout=CLIENT_TIMEOUT
        )
        try:
            downstream = SimulatorDownstream(sim_control, sim_proxy)
            yield Subject(gateway, downstream, refunds(sim_tenant.name))
        finally:
            gateway.close()
