"""The deadline fence's probe against the real simulator over HTTP: a fenced simulator refuses
it with ``408 deadline_exceeded`` before anything else (nothing counted, nothing executed), one
with its fence off answers 400 and executes nothing, and the start's check
(``settled.preflight.check_fences``) refuses a declared fence that is not kept, or cannot be
reached, naming the kind and its URL and never a key."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from outbox.errors import FenceNotVerified
from outbox.kinds import default_registry
from outbox.settings import Settings
from outbox.settings_contracts import ContractSettings
from settled.preflight import check_fences
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.support.services import free_port
from tests.support.simtools import SimTenant
from workers.http_client import HttpGateway

REGISTRY = default_registry()


def nothing_recorded(control: SimulatorControl) -> None:
    ledger = control.ledger()
    assert (ledger["effects"], ledger["in_flight"], ledger["requests"]) == ([], [], [])


def test_a_fenced_simulator_refuses_the_probe_of_every_kind_first(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.create_order("acme", "A1042", 10**6)
    # Faults on every submit: the probe is answered before any is drawn.
    sim_control.add_rule("503_before")
    for name in REGISTRY.names():
        found = sim_gateway.probe_fence(REGISTRY.get(name))
        assert found.verified, (name, found)
        assert found.detail == "refused a request past its deadline: 408 deadline_exceeded"
    nothing_recorded(sim_control)  # not even counted as a request


def test_a_simulator_without_its_fence_fails_the_probe_and_executes_nothing(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.create_order("acme", "A1042", 10**6)
    sim_control.set_switches(deadline_fence=False)
    for name in REGISTRY.names():
        found = sim_gateway.probe_fence(REGISTRY.get(name))
        assert not found.verified
        assert found.detail.startswith("answered HTTP 400 invalid_request"), found
    ledger = sim_control.ledger()
    assert (ledger["effects"], ledger["in_flight"]) == ([], [])
    assert sim_control.refunded("acme", "A1042") == 0


def settings(url: str, tenant: SimTenant, **contracts: ContractSettings) -> Settings:
    return Settings(
        downstream_url=url,
        downstream_api_keys={tenant.name: tenant.api_key},
        downstream_timeout=2.0,
        downstream_contracts=contracts,
    )


FENCED = ContractSettings(enforces_deadline=True)


def test_the_start_check_probes_each_fenced_kind_and_no_other(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    configured = settings(simulator.url, sim_tenant, refund=FENCED, pickup=FENCED)
    checks = check_fences(configured, configured.apply_contracts(REGISTRY))
    assert [(c.kind, c.url, c.probe.verified) for c in checks] == [
        ("pickup", simulator.url + "/v1/pickups", True),
        ("refund", simulator.url + "/v1/refunds", True),
    ]
    unfenced = settings(simulator.url, sim_tenant)
    assert check_fences(unfenced, unfenced.apply_contracts(REGISTRY)) == ()
    sim_control.set_switches(deadline_fence=False)
    with pytest.raises(FenceNotVerified):
        check_fences(configured, configured.apply_contracts(REGISTRY))
    # Only the two fenced kinds were asked (a probe the fence does not refuse is counted).
    probed = {r["idempotency_key"] for r in sim_control.ledger()["requests"]}
    assert len(probed) == 2


def test_a_fence_the_downstream_does_not_keep_stops_the_start_naming_kind_and_url(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    sim_control.set_switches(deadline_fence=False)
    configured = settings(simulator.url, sim_tenant, refund=FENCED)
    with pytest.raises(FenceNotVerified) as refused:
        check_fences(configured, configured.apply_contracts(REGISTRY))
    error = refused.value
    url = simulator.url + "/v1/refunds"
    assert error.data == {
        "setting": "SETTLED_DOWNSTREAM_CONTRACTS",
        "kinds": ["refund"],
        "urls": [url],
    }
    assert f"kind 'refund' at {url}: answered HTTP 400 invalid_request" in error.message
    assert sim_tenant.api_key.get_secret_value() not in error.message
    assert sim_control.ledger()["effects"] == []


def test_an_unreachable_downstream_stops_the_start_too(sim_tenant: SimTenant) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    configured = settings(url, sim_tenant, refund=FENCED)
    with pytest.raises(FenceNotVerified) as refused:
        check_fences(configured, configured.apply_contracts(REGISTRY))
    assert (
        f"kind 'refund' at {url}/v1/refunds: no answer (ConnectError): the fence could not "
        "be checked" in refused.value.message
    )


def test_a_wrong_api_key_verifies_nothing(
    simulator: SimulatorHandle, sim_tenant: SimTenant
) -> None:
    wrong = SimTenant(sim_tenant.name, SecretStr("sk_test_wrong"))
    configured = settings(simulator.url, wrong, refund=FENCED)
    with pytest.raises(FenceNotVerified) as refused:
        check_fences(configured, configured.apply_contracts(REGISTRY))
    assert "answered HTTP 401 authentication_error" in refused.value.message
    assert "sk_test_wrong" not in refused.value.message
