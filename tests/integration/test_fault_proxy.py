"""HttpGateway through the TCP fault proxy: refused, delayed and cut connections."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    LookupOutcome,
    NotFound,
    NotSent,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from settled.simulator import SimulatorControl
from settled.simulator.proxy import FaultProxy
from tests.support.simtools import SimTenant, wait_until
from workers.http_client import HttpGateway

REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1", "amount_minor": 2500, "currency": "CNY", "payee": "P1"}
KEY = "stl_proxy_key_1"
OP_ID = "op-1"


def submit(gw: HttpGateway) -> SubmitOutcome:
    return gw.submit(
        DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS),
        deadline=datetime.now(UTC) + timedelta(seconds=30),
    )


def lookup(gw: HttpGateway) -> LookupOutcome:
    return gw.lookup(
        DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS),
        deadline=datetime.now(UTC) + timedelta(seconds=30),
    )


@pytest.fixture(autouse=True)
def order(sim_control: SimulatorControl, sim_tenant: SimTenant) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10000, "CNY")


def test_passthrough_forwards_faithfully(
    proxied_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    assert isinstance(submit(proxied_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_refused_connection_is_not_sent_and_nothing_reaches_the_downstream(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    sim_proxy.refuse()
    assert submit(proxied_gateway) == NotSent("ConnectError", SendPhase.CONNECT)
    assert sim_control.requests("acme", KEY) == 0
    sim_proxy.passthrough()
    assert isinstance(submit(proxied_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_response_delayed_past_the_timeout_is_unknown_though_the_refund_happened(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    sim_proxy.delay(30)
    assert submit(proxied_gateway) == Unknown("ReadTimeout")
    wait_until(lambda: sim_control.effects("acme", KEY) == 1, what="the refund")
    sim_proxy.passthrough()
    assert isinstance(submit(proxied_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_response_cut_midway_is_unknown_though_the_refund_happened(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    sim_proxy.cut(after_bytes=20)
    outcome = submit(proxied_gateway)
    assert isinstance(outcome, Unknown)
    assert outcome.detail in {"ReadError", "RemoteProtocolError"}
    wait_until(lambda: sim_control.effects("acme", KEY) == 1, what="the refund")


def test_lookup_cut_midway_is_unavailable(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy
) -> None:
    assert isinstance(submit(proxied_gateway), Accepted)
    sim_proxy.cut(after_bytes=40)
    assert isinstance(lookup(proxied_gateway), Unavailable)
    sim_proxy.passthrough()
    assert isinstance(lookup(proxied_gateway), Found)


def test_a_fault_aimed_at_some_requests_leaves_the_others_alone(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    """``only``: the cut meets the sends (POST), not the lookups (GET) on the same connection;
    what lets a provider's read before its send pass while the send's answer is lost."""
    sim_proxy.cut(after_bytes=20, only=b"POST ")
    assert isinstance(lookup(proxied_gateway), NotFound)
    assert isinstance(submit(proxied_gateway), Unknown)
    wait_until(lambda: sim_control.effects("acme", KEY) == 1, what="the refund")
    assert isinstance(lookup(proxied_gateway), Found)
    sim_proxy.delay(30, only=b"GET ")
    assert isinstance(submit(proxied_gateway), Accepted)  # the replay's answer is not held
    assert isinstance(lookup(proxied_gateway), Unavailable)


def test_refuse_also_ends_open_connections_so_nothing_is_sent_on_them(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    assert isinstance(submit(proxied_gateway), Accepted)  # leaves a kept-alive connection
    sim_proxy.refuse()
    outcome = proxied_gateway.submit(
        DownstreamRequest("acme", OP_ID, REFUND, "stl_proxy_key_2", PARAMS),
        deadline=datetime.now(UTC) + timedelta(seconds=30),
    )
    assert outcome == NotSent("ConnectError", SendPhase.CONNECT)
    assert sim_control.requests("acme", "stl_proxy_key_2") == 0


def test_an_outage_refuses_connections_for_its_window_then_forwards_again(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy, sim_control: SimulatorControl
) -> None:
    sim_proxy.refuse_for(1.0)
    assert sim_proxy.refusing
    assert submit(proxied_gateway) == NotSent("ConnectError", SendPhase.CONNECT)
    assert sim_control.requests("acme", KEY) == 0
    wait_until(lambda: not sim_proxy.refusing, 10, "the outage to end")
    assert isinstance(submit(proxied_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_a_mode_set_during_an_outage_is_not_undone_when_it_ends(
    proxied_gateway: HttpGateway, sim_proxy: FaultProxy
) -> None:
    sim_proxy.refuse_for(0.2)
    sim_proxy.refuse()  # an operator's refusal, with no end
    outage = sim_proxy._outage
    assert outage is not None
    outage.join(10)  # the window's end has run
    assert sim_proxy.refusing
    assert submit(proxied_gateway) == NotSent("ConnectError", SendPhase.CONNECT)
