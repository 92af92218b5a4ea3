"""HttpGateway against a running simulator: one test per fault, judged by outcome AND ledger."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from outbox import wire
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason
from settled.simulator import Fault, SimulatorControl, SimulatorHandle, start_in_thread
from tests.support.simtools import CLIENT_TIMEOUT, SimTenant, wait_until
from workers.http_client import POOL_SIZE, HttpGateway

REGISTRY = default_registry()
REFUND = REGISTRY.get("refund")
PARAMS = {"order_id": "A1", "amount_minor": 2500, "currency": "CNY", "payee": "P1"}
KEY = "stl_fault_key_1"
OP_ID = "op-1"


def deadline(seconds: float = 30.0) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def submit(gw: HttpGateway, key: str = KEY, params: Mapping[str, Any] = PARAMS) -> SubmitOutcome:
    return gw.submit(DownstreamRequest("acme", OP_ID, REFUND, key, params), deadline=deadline())


def lookup(gw: HttpGateway, key: str = KEY, params: Mapping[str, Any] = PARAMS) -> LookupOutcome:
    return gw.lookup(DownstreamRequest("acme", OP_ID, REFUND, key, params), deadline=deadline())


@pytest.fixture(autouse=True)
def order(sim_control: SimulatorControl, sim_tenant: SimTenant) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10000, "CNY")


def test_clean_submit_is_accepted_and_refunds_once(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    outcome = submit(sim_gateway)
    assert isinstance(outcome, Accepted)
    assert outcome.receipt.params == PARAMS
    found = lookup(sim_gateway)
    assert isinstance(found, Found)
    assert found.receipt.reference == outcome.receipt.reference
    assert sim_control.effects("acme", KEY) == 1
    assert sim_control.refunded("acme", "A1") == 2500


def test_commit_then_timeout_is_unknown_with_exactly_one_refund(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.COMMIT_THEN_TIMEOUT, KEY, times=1)
    outcome = submit(sim_gateway)
    assert outcome == Unknown("ReadTimeout")
    assert sim_control.effects("acme", KEY) == 1
    # The same key settles it without a second refund.
    again = submit(sim_gateway)
    assert isinstance(again, Accepted)
    assert sim_control.effects("acme", KEY) == 1
    assert sim_control.refunded("acme", "A1") == 2500


def test_commit_then_reset_is_unknown_and_lookup_finds_the_refund(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.COMMIT_THEN_RESET, KEY, times=1)
    outcome = submit(sim_gateway)
    assert isinstance(outcome, Unknown)
    assert outcome.detail in {"ReadError", "RemoteProtocolError"}
    assert isinstance(lookup(sim_gateway), Found)
    assert sim_control.effects("acme", KEY) == 1


def test_reset_before_is_unknown_with_zero_effects_and_lookup_not_found(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.RESET_BEFORE, KEY, times=1)
    outcome = submit(sim_gateway)
    assert isinstance(outcome, Unknown)
    assert sim_control.effects("acme", KEY) == 0
    assert sim_control.requests("acme", KEY) == 1
    assert lookup(sim_gateway) == LookupNotFound()
    assert isinstance(submit(sim_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_503_before_is_unknown_under_the_default_contract_and_executes_nothing(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, KEY, times=1)
    outcome = submit(sim_gateway)
    assert isinstance(outcome, Unknown)
    assert outcome.status == 503
    assert sim_control.effects("acme", KEY) == 0


def test_503_before_is_not_executed_when_the_contract_documents_it(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    kind = REGISTRY.with_contract("refund", not_executed_statuses=frozenset({429, 503}))
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, KEY, times=1)
    outcome = sim_gateway.submit(
        DownstreamRequest("acme", OP_ID, kind.get("refund"), KEY, PARAMS), deadline=deadline()
    )
    assert outcome == NotExecuted(503, None)
    assert sim_control.effects("acme", KEY) == 0


def test_503_after_commit_is_unknown_replayed_and_lookup_finds_the_refund(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.UNAVAILABLE_AFTER_COMMIT, KEY, times=1)
    assert isinstance(submit(sim_gateway), Unknown)
    replay = submit(sim_gateway)
    assert isinstance(replay, Unknown)
    assert replay.status == 503
    assert isinstance(lookup(sim_gateway), Found)
    assert sim_control.effects("acme", KEY) == 1


@pytest.mark.parametrize("retry_after", ["2", "http-date"])
def test_429_is_not_executed_with_retry_after_and_zero_effects(
    sim_gateway: HttpGateway, sim_control: SimulatorControl, retry_after: str
) -> None:
    value = retry_after
    if retry_after == "http-date":
        value = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    sim_control.add_rule(Fault.RATE_LIMITED, KEY, times=1, retry_after=value)
    outcome = submit(sim_gateway)
    assert isinstance(outcome, NotExecuted)
    assert outcome.status == 429
    assert outcome.retry_after is not None
    if retry_after == "2":
        assert outcome.retry_after == 2.0
    else:
        assert 100 < outcome.retry_after <= 120
    assert sim_control.effects("acme", KEY) == 0
    assert lookup(sim_gateway) == LookupNotFound()


def test_business_reject_is_refused_and_lookup_finds_the_refusal(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.BUSINESS_REJECT, KEY, times=1, code="payee_blocked")
    outcome = submit(sim_gateway)
    assert outcome == Refused(RejectReason.BUSINESS_REJECTED, "payee_blocked", 402)
    found = lookup(sim_gateway)
    assert isinstance(found, Found)
    assert (found.receipt.status, found.reason, found.code) == (
        "rejected",
        RejectReason.BUSINESS_REJECTED,
        "payee_blocked",
    )
    assert sim_control.effects("acme", KEY) == 0


def test_real_refusal_refund_beyond_the_order_is_business_rejected(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    outcome = submit(sim_gateway, params={**PARAMS, "amount_minor": 10001})
    assert outcome == Refused(RejectReason.BUSINESS_REJECTED, "amount_exceeds_refundable", 402)
    assert sim_control.refunded("acme", "A1") == 0


def test_invalid_params_are_refused_as_invalid(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    outcome = submit(sim_gateway, params={**PARAMS, "amount_minor": -5})
    assert isinstance(outcome, Refused)
    assert outcome.reason is RejectReason.INVALID_PARAMS
    assert sim_control.ledger()["effects"] == []


def test_mismatched_receipt_is_misuse_and_lookup_misuse_though_the_refund_happened(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.MISMATCHED_RECEIPT, KEY, times=1)
    outcome = submit(sim_gateway)
    assert isinstance(outcome, Misuse)
    assert outcome.code == "receipt_mismatch"
    assert isinstance(lookup(sim_gateway), LookupMisuse)
    assert sim_control.effects("acme", KEY) == 1


def test_lookup_unavailable_is_unavailable_then_found(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    assert isinstance(submit(sim_gateway), Accepted)
    sim_control.add_rule(Fault.LOOKUP_UNAVAILABLE, KEY, times=1)
    assert lookup(sim_gateway) == Unavailable("lookup answered HTTP 503")
    assert isinstance(lookup(sim_gateway), Found)


def test_lookup_switched_off_is_unavailable_never_not_found(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.set_switches(lookup=False)
    assert isinstance(lookup(sim_gateway), Unavailable)


def test_same_key_with_other_params_is_misuse_and_refunds_nothing_more(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    assert isinstance(submit(sim_gateway), Accepted)
    outcome = submit(sim_gateway, params={**PARAMS, "amount_minor": 2600})
    assert isinstance(outcome, Misuse)
    assert outcome.code == "idempotency_error"
    assert sim_control.refunded("acme", "A1") == 2500


def test_key_in_flight_is_unknown_and_the_held_attempt_refunds_once(
    simulator: SimulatorHandle,
    sim_tenant: SimTenant,
    sim_gateway: HttpGateway,
    sim_control: SimulatorControl,
) -> None:
    sim_control.add_rule(Fault.HOLD_BEFORE_COMMIT, KEY, times=1, hold_seconds=30)
    outcomes: list[SubmitOutcome] = []
    # The held attempt waits longer than the test needs, so it is still in flight when the
    # concurrent one arrives however slow the machine is.
    patient = HttpGateway(simulator.url, {"acme": sim_tenant.api_key}, timeout=30)
    first = threading.Thread(target=lambda: outcomes.append(submit(patient)))
    first.start()
    try:
        sim_control.wait_in_flight("acme", KEY)
        concurrent = submit(sim_gateway)
        assert isinstance(concurrent, Unknown)
        assert concurrent.status == 409
        assert sim_control.effects("acme", KEY) == 0
    finally:
        sim_control.release_holds()
        first.join()
        patient.close()
    assert len(outcomes) == 1
    assert isinstance(outcomes[0], Accepted)
    assert isinstance(submit(sim_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_held_attempt_abandoned_by_its_client_still_executes_once(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.HOLD_BEFORE_COMMIT, KEY, times=1, hold_seconds=30)
    assert submit(sim_gateway) == Unknown("ReadTimeout")
    wait_until(lambda: sim_control.effects("acme", KEY) == 1, what="the abandoned refund")
    assert isinstance(submit(sim_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 1


def test_keys_past_retention_execute_again_which_is_why_nothing_resends_then(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    # The simulator's clock is moved an hour past ours below: its deadline fence would refuse
    # every request (rightly: far beyond the clock margin). This test is about retention.
    sim_control.set_switches(key_retention_seconds=3600, deadline_fence=False)
    assert isinstance(submit(sim_gateway), Accepted)
    sim_control.advance_clock(3601)
    assert lookup(sim_gateway) == LookupNotFound()
    assert isinstance(submit(sim_gateway), Accepted)
    assert sim_control.effects("acme", KEY) == 2


def test_wrong_api_key_is_permission_denied_and_executes_nothing(
    simulator: SimulatorHandle, sim_control: SimulatorControl
) -> None:
    with HttpGateway(
        simulator.url, {"acme": SecretStr("sk_test_wrong")}, timeout=CLIENT_TIMEOUT
    ) as gw:
        outcome = submit(gw)
    assert outcome == Refused(RejectReason.PERMISSION_DENIED, "invalid_api_key", 401)
    assert sim_control.ledger()["effects"] == []


def test_connection_refused_is_not_sent() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with HttpGateway(
        f"http://127.0.0.1:{port}", {"acme": SecretStr("k")}, timeout=CLIENT_TIMEOUT
    ) as gw:
        assert submit(gw) == NotSent("ConnectError", SendPhase.CONNECT)
        assert lookup(gw) == Unavailable("ConnectError")


def test_deadline_reaches_the_downstream_in_the_header(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    when = deadline(CLIENT_TIMEOUT / 2)  # comes before the client's own timeout
    sim_gateway.submit(DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=when)
    (row,) = sim_control.ledger()["requests"]
    assert row["last_deadline"] == wire.format_deadline(when)


def test_the_header_deadline_is_the_client_timeout_when_that_comes_first(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    before = datetime.now(UTC)
    sim_gateway.submit(
        DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline(3600)
    )
    (row,) = sim_control.ledger()["requests"]
    told = wire.parse_deadline(row["last_deadline"])
    assert told is not None
    timeout = timedelta(seconds=CLIENT_TIMEOUT)
    assert before + timeout - timedelta(seconds=0.01) <= told <= datetime.now(UTC) + timeout


def test_passed_deadline_sends_nothing(
    sim_gateway: HttpGateway, sim_control: SimulatorControl
) -> None:
    outcome = sim_gateway.submit(
        DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS),
        deadline=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert isinstance(outcome, NotSent)
    assert sim_control.ledger()["requests"] == []


def test_seeded_schedule_never_gives_two_refunds_per_key(
    sim_gateway: HttpGateway, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10**9, "CNY")
    sim_control.set_schedule(
        seed=42,
        probabilities={
            Fault.COMMIT_THEN_RESET: 0.2,
            Fault.RESET_BEFORE: 0.2,
            Fault.UNAVAILABLE_AFTER_COMMIT: 0.1,
            Fault.RATE_LIMITED: 0.1,
        },
    )
    keys = [f"stl_sched_{i}" for i in range(15)]
    for key in keys:
        for _ in range(4):  # the same key, resent: never a second effect
            submit(sim_gateway, key=key)
    ledger = sim_control.ledger()
    counts = {key: sim_control.effects("acme", key) for key in keys}
    assert max(counts.values()) == 1
    assert {e["idempotency_key"] for e in ledger["effects"]} <= set(keys)


# -- kept-alive connections -----------------------------------------------------------------


def test_connection_the_server_closed_while_idle_is_not_reused(tmp_path: Path) -> None:
    # The server drops idle connections long before the gateway would (the reverse of the
    # configured relation): the next attempt must connect anew, not fail on the dead one.
    with start_in_thread(
        ledger=str(tmp_path / "ledger.sqlite3"), tenants={"acme": "sk_1"}, idle_timeout=0.2
    ) as sim:
        with SimulatorControl(sim.url) as control:
            control.create_order("acme", "A1", 10000, "CNY")
        with HttpGateway(sim.url, {"acme": SecretStr("sk_1")}, timeout=CLIENT_TIMEOUT) as gw:
            assert isinstance(submit(gw, key="k1"), Accepted)
            wait_until(lambda: sim.open_connections() == 0, what="the server to drop idle ones")
            assert isinstance(submit(gw, key="k2"), Accepted)
            assert isinstance(lookup(gw, key="k1"), Found)
        with SimulatorControl(sim.url) as control:
            assert control.effects("acme", "k1") == 1
            assert control.effects("acme", "k2") == 1
            assert control.requests("acme", "k2") == 1


def test_one_gateway_serves_many_threads_at_once(
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    request: pytest.FixtureRequest,
) -> None:
    # About concurrency, not timeouts: a patient client, so that a loaded machine answering
    # one of the POOL_SIZE concurrent requests late does not turn it into an "unknown".
    sim_gateway = HttpGateway(simulator.url, {sim_tenant.name: sim_tenant.api_key}, timeout=30)
    request.addfinalizer(sim_gateway.close)
    sim_control.create_order(sim_tenant.name, "A1", 10**6, "CNY")
    threads, rounds = POOL_SIZE, 4
    small = {**PARAMS, "amount_minor": 1}
    start = threading.Barrier(threads)
    outcomes: dict[str, SubmitOutcome] = {}

    def send(worker: int) -> None:
        start.wait()
        for i in range(rounds):
            key = f"stl_conc_{worker}_{i}"
            outcomes[key] = submit(sim_gateway, key=key, params=small)

    workers = [threading.Thread(target=send, args=(w,)) for w in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(outcomes) == threads * rounds
    assert {k: o for k, o in outcomes.items() if not isinstance(o, Accepted)} == {}
    ledger = sim_control.ledger()
    assert sorted(e["idempotency_key"] for e in ledger["effects"]) == sorted(outcomes)
    assert all(row["count"] == 1 for row in ledger["requests"])
    assert sim_control.refunded("acme", "A1") == threads * rounds
