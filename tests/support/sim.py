"""Pytest fixtures for the payment simulator (a plugin module: ``pytest_plugins``).

``simulator`` is a running simulator in test mode on a free 127.0.0.1 port with a fresh ledger
file; ``sim_control`` drives it; ``sim_tenant`` is a registered tenant; ``sim_gateway`` is an
``HttpGateway`` with that tenant's key and a short timeout; ``sim_proxy`` is a ``FaultProxy`` in
front of the simulator and ``proxied_gateway`` talks through it.

Helpers (``SimTenant``, ``wait_until``, ``CLIENT_TIMEOUT``) live in ``tests.support.simtools``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from settled.simulator import SimulatorControl, SimulatorHandle, start_in_thread
from settled.simulator.proxy import FaultProxy
from tests.support.simtools import CLIENT_TIMEOUT, SimTenant
from workers.http_client import HttpGateway


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[SimulatorHandle]:
    handle = start_in_thread(ledger=str(tmp_path / "simulator.sqlite3"), test_mode=True)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def sim_control(simulator: SimulatorHandle) -> Iterator[SimulatorControl]:
    with SimulatorControl(simulator.url) as control:
        yield control


@pytest.fixture
def sim_tenant(sim_control: SimulatorControl) -> SimTenant:
    tenant = SimTenant("acme", SecretStr("sk_test_acme_4f1c9a7e"))
    sim_control.add_tenant(tenant.name, tenant.api_key.get_secret_value())
    return tenant


@pytest.fixture
def sim_gateway(simulator: SimulatorHandle, sim_tenant: SimTenant) -> Iterator[HttpGateway]:
    with HttpGateway(
        simulator.url, {sim_tenant.name: sim_tenant.api_key}, timeout=CLIENT_TIMEOUT
    ) as gateway:
        yield gateway


@pytest.fixture
def sim_proxy(simulator: SimulatorHandle) -> Iterator[FaultProxy]:
    with FaultProxy(simulator.host, simulator.port) as proxy:
        yield proxy


@pytest.fixture
def proxied_gateway(sim_proxy: FaultProxy, sim_tenant: SimTenant) -> Iterator[HttpGateway]:
    with HttpGateway(
        sim_proxy.url, {sim_tenant.name: sim_tenant.api_key}, timeout=CLIENT_TIMEOUT
    ) as gateway:
        yield gateway
