"""The crash and fault tests, run against every provider mode of the simulator (the wire
protocol's, Stripe's, WeChat Pay's and Alipay's) through that provider's gateway, and judged by
the same ledger (``check_truthful`` at the rig's teardown): a worker killed at each of its
failpoints, connections refused, answers delayed or cut by the fault proxy, a worker that died
mid-send found by recovery lookups, a paused worker beside the new owner, and real ``settled
worker`` processes built from each provider's settings, SIGKILLed after the claim and after the
send.

``CRASHES_AND_FAULTS`` are existing tests of the wire protocol (run there on both databases),
run again here in each provider's mode; the tests below the list are stated once, for all four
modes unless a comment says why not. The executor's, reconciler's and review's guarantees
(commit then timeout, reset, 5xx after commit, rate limits, lookup unavailable) run per mode
from ``test_stripe_mode.GUARANTEES``.

The fault tests left to the wire protocol are named, with why, at the end of the list.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.intake import Outbox
from outbox.states import State
from settled.simulator import SimulatorControl, SimulatorHandle
from settled.simulator.proxy import FaultProxy
from tests.integration import test_reconciler as reconciler_tests
from tests.integration import test_recovery_lookups as recovery_tests
from tests.integration import test_send_fencing as fencing_tests
from tests.integration.test_celery_worker import GOOD, App
from tests.support.judge import check_truthful
from tests.support.rig import Rig
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack, provider_env
from workers.alipay_gateway import AlipayGateway
from workers.failpoints import STEPS, FailpointHit, arm
from workers.http_client import HttpGateway
from workers.stripe_gateway import StripeGateway
from workers.wechatpay_gateway import WechatPayGateway

#: Existing crash and fault tests of the wire protocol, re-run in each provider's mode.
CRASHES_AND_FAULTS: list[Callable[[Rig], None]] = [
    # a reset after the refusal was made: the lookup's receipt settles it (wire protocol only:
    # no provider keeps a refused refund to be found)
    # reconciler_tests.test_business_refusal_found_by_lookup_is_rejected_with_the_receipt,
    # a worker lost between its commit and its send; the look at it fails, then a later one
    fencing_tests.test_a_failed_look_at_an_abandoned_send_leaves_it_to_a_later_pass,
    # a worker paused past its lease: it never sends beside the new owner
    fencing_tests.test_a_worker_paused_past_its_lease_never_sends_beside_the_new_owner,
    # a send abandoned before it left: "not found" is not sent again before quiescence (that
    # it is unknown: the failpoint test's after_claim below)
    reconciler_tests.test_not_found_inside_quiescence_takes_no_action,
    # Wire protocol only:
    # test_gateway_faults, test_fault_proxy: HttpGateway's own outcomes, header and pool
    #   (what each provider's gateway makes of these faults: the executor's tests here)
    # test_celery_worker (SIGKILL at each step), test_outage: real workers built for the wire
    #   protocol (the same failpoints fired in process in every mode below, and real workers
    #   built for each provider killed after the claim and after the send: after the outcome
    #   nothing is left for a provider to answer)
    # test_deadline_fence, test_transport_bounds: the deadline fence only the wire protocol
    #   enforces, and its transport's bounds
    # Wire protocol only for test time (the provider's part is met above): test_reconciler's
    #   two reconcilers at once and found-later closing review, test_executor's persistent 503s
]

#: A worker that died mid-send, found by lookups each with its own time and none past the lease
#: (each operation refunds an order of its own: Stripe's lookup lists the payment intent's
#: refunds, which counts as a lookup of every refund on it).
DEAD_WORKER_LOOKUPS: list[Callable[[Rig], None]] = [
    recovery_tests.test_each_recovery_lookup_of_a_batch_has_its_own_time,
    recovery_tests.test_a_recovery_lookup_the_lease_leaves_no_time_for_is_not_asked,
    reconciler_tests.test_a_dead_workers_send_the_lease_leaves_no_time_to_ask_about_stays_as_it_was,
]

#: Provider modes besides the wire protocol's (which runs these tests in their own files).
PROVIDERS = ["stripe", "wechatpay", "alipay"]


# Once, on PostgreSQL: the provider is what differs here, not the database.
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("provider_rig", PROVIDERS, indirect=True)
@pytest.mark.parametrize("test", CRASHES_AND_FAULTS, ids=lambda test: test.__name__[5:])
def test_crash_or_fault_holds_in_provider_mode(
    provider_rig: Rig, test: Callable[[Rig], None]
) -> None:
    test(provider_rig)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("provider_rig", PROVIDERS, indirect=True)
@pytest.mark.parametrize("test", DEAD_WORKER_LOOKUPS, ids=lambda test: test.__name__[5:])
def test_a_dead_workers_send_is_looked_up_in_provider_mode(
    provider_rig: Rig, test: Callable[[Rig], None]
) -> None:
    test(provider_rig)


GATEWAYS = {
    "http": HttpGateway,
    "stripe": StripeGateway,
    "wechatpay": WechatPayGateway,
    "alipay": AlipayGateway,
}


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_the_provider_rig_speaks_each_providers_protocol(
    provider_rig: Rig, request: pytest.FixtureRequest
) -> None:
    """What makes the tests above worth their time: in each mode, the executor and the
    reconciler send through that provider's gateway, and the refund lands in the ledger."""
    rig = provider_rig
    mode = request.node.callspec.params["provider_rig"]
    executor = rig.executor()
    assert type(executor.gateway) is GATEWAYS[mode]
    assert type(rig.reconciler().gateway) is GATEWAYS[mode]
    op = rig.enqueue()
    assert executor.execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1 and rig.control.refunded("acme", "A1042") == 10000


def lapse(rig: Rig, op: int) -> None:
    """The dead worker's lease runs out (no sleeping: the test moves it)."""
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("step", STEPS)
def test_a_worker_killed_at_each_failpoint_loses_nothing_and_duplicates_nothing(
    provider_rig: Rig, step: str
) -> None:
    """The worker dies at ``step`` (the failpoint the project ships, fired in process), as
    ``test_celery_worker`` kills a real worker there: one refund, one send, whatever the
    provider."""
    rig = provider_rig
    op = rig.enqueue()
    with arm(step), pytest.raises(FailpointHit):
        rig.executor(worker="dead").execute([op])
    if step == "after_claim":
        # Nothing was sent: the recovery lookup finds nothing (unknown); once the attempt is
        # quiet the reconciler requeues it with the same key, and it is sent once.
        lapse(rig, op)
        assert rig.executor(worker="next").execute([op]) == {op: State.UNKNOWN}
        assert rig.sends(op) == 0
        rig.make_quiet(op)
        assert rig.reconciler().run_once().outcomes == {"requeued": 1}
        rig.make_due(op)
        assert rig.executor(worker="next").execute([op]) == {op: State.SUCCEEDED}
    elif step == "after_send":
        # Sent, nothing recorded: the recovery lookup finds the refund.
        lapse(rig, op)
        assert rig.executor(worker="next").execute([op]) == {op: State.SUCCEEDED}
        assert rig.op(op).lookups == 1
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1 and rig.sends(op) == 1
    assert rig.control.refunded("acme", "A1042") == 10000


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_refused_connection_is_not_sent_and_the_retry_refunds_once(
    provider_rig: Rig, sim_proxy: FaultProxy
) -> None:
    rig = provider_rig
    op = rig.enqueue()
    sim_proxy.refuse()
    assert rig.executor(url=sim_proxy.url).execute([op]) == {op: State.PLANNED}
    assert [a.proof for a in rig.attempts(op)] == ["not_sent"]
    assert rig.sends(op) == 0
    sim_proxy.passthrough()
    rig.make_due(op)
    assert rig.executor(url=sim_proxy.url).execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1 and rig.sends(op) == 1


#: The requests a send's fault is aimed at, by mode: Stripe's gateway reads the payment intent
#: (a GET) before its first refund request (a POST), and that read must reach Stripe.
SEND_REQUESTS = {"stripe": b"POST "}


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("provider_rig", ["http", *PROVIDERS], indirect=True)
@pytest.mark.parametrize("fault", ["delay", "cut"])
def test_an_answer_delayed_or_cut_by_the_network_is_unknown_and_reconciled_once(
    provider_rig: Rig, sim_proxy: FaultProxy, fault: str, request: pytest.FixtureRequest
) -> None:
    """The refund is made; its answer is held past the client's timeout, or cut midway: the
    operation is unknown (never rejected, never sent again), and the reconciler's lookup
    settles it from the provider's record; a lookup cut midway is only "unavailable"."""
    rig = provider_rig
    sends = SEND_REQUESTS.get(request.node.callspec.params["provider_rig"])
    op = rig.enqueue()
    if fault == "delay":
        sim_proxy.delay(30, only=sends)
    else:
        sim_proxy.cut(after_bytes=20, only=sends)
    assert rig.executor(url=sim_proxy.url).execute([op]) == {op: State.UNKNOWN}
    wait_until(lambda: rig.effects(op) == 1, what="the refund the lost answer was for")
    sim_proxy.cut(after_bytes=40)
    lookups = rig.reconciler()
    lookups.gateway = rig.gateway(sim_proxy.url)
    assert lookups.run_once().outcomes == {"lookup_unavailable": 1}
    assert rig.op(op).state == "unknown"
    sim_proxy.passthrough()
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1 and rig.sends(op) == 1


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("provider_rig", ["stripe"], indirect=True)
@pytest.mark.parametrize("fault", ["delay", "cut"])
def test_a_payment_intent_read_delayed_or_cut_sends_nothing_and_the_retry_refunds_once(
    provider_rig: Rig, sim_proxy: FaultProxy, fault: str
) -> None:
    """Stripe's read of the payment intent before the refund (a GET) is held past the client's
    timeout or cut midway: the refund was never asked for, so the operation stays planned (not
    unknown, nothing to look up), and the retry refunds once."""
    rig = provider_rig
    op = rig.enqueue()
    if fault == "delay":
        sim_proxy.delay(30, only=b"GET ")
    else:
        sim_proxy.cut(after_bytes=20, only=b"GET ")
    assert rig.executor(url=sim_proxy.url).execute([op]) == {op: State.PLANNED}
    assert [a.proof for a in rig.attempts(op)] == ["not_sent"]
    assert rig.sends(op) == 0 and rig.effects(op) == 0
    sim_proxy.passthrough()
    rig.make_due(op)
    assert rig.executor(url=sim_proxy.url).execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1 and rig.sends(op) == 1


#: Where a real worker is SIGKILLed, and the path its operation then takes to ``succeeded``.
REAL_WORKER_KILLS = {
    # never sent: the lookups find nothing, so unknown; long before that proves anything (the
    # provider's default delay bound is 5 minutes) the reconciler has it sent again with the
    # same key, and it is sent once
    "after_claim": ["planned", "submitted", "unknown", "submitted", "succeeded"],
    # sent, not recorded: the next worker's recovery lookup finds the refund
    "after_send": ["planned", "submitted", "succeeded"],
}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("mode", PROVIDERS)
def test_real_workers_killed_after_the_claim_and_after_the_send_are_recovered_with_one_send(
    pg: Engine,
    pg_url: str,
    redis_url: str,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    outbox: Outbox,
    tmp_path: Path,
    mode: str,
) -> None:
    """``test_celery_worker``'s SIGKILL after the claim and after the send, with workers built
    from settings that send refunds to the provider (the simulator's mode of it): a worker with
    beat finds both operations, looks them up through the provider's gateway, and each is sent
    once. The two kills share one stack, to start the workers once: both victims start together,
    and each takes one operation (the first to take one dies before the second is enqueued; they
    claim only the operations they are hinted)."""
    env = provider_env(mode, simulator.url, sim_control, sim_tenant)  # the default contract
    stack = Stack(
        database_url=pg_url,
        broker_url=redis_url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
        env_extra=env,
    )
    app = App(stack, pg, outbox, hint_doorbell=0)  # a hint per transaction, naming its operation

    def enqueue(order_id: str) -> int:
        """A refund of its own order (Stripe's lookup lists an order's refunds)."""
        sim_control.create_order("acme", order_id, 10**9)
        with app.sessions.begin() as s:
            got = outbox.enqueue(
                s,
                tenant="acme",
                op_id=order_id,
                kind="refund",
                params={**GOOD, "order_id": order_id},
            )
        return got.id

    try:
        victims = {
            step: stack.start_worker(
                SETTLED_FAILPOINT=step,
                SETTLED_FAILPOINT_MARKER=str(tmp_path / f"{step}-fired"),
                SETTLED_CLAIM_BATCH="0",
            )
            for step in REAL_WORKER_KILLS
        }
        ops: dict[str, tuple[int, str]] = {}  # by step: the operation, its order

        def killed() -> list[str]:
            return [s for s, v in victims.items() if s not in ops and v.poll() is not None]

        for order_id in ("A1042", "A1043"):
            op = enqueue(order_id)
            wait_until(lambda: bool(killed()), 60, "a victim dies")
            (step,) = killed()
            ops[step] = (op, order_id)
            assert victims[step].returncode == -signal.SIGKILL
            assert (tmp_path / f"{step}-fired").exists()
        stack.start_worker(beat=True)  # the sweeper and the reconciler bring both back
        wait_until(
            lambda: set(app.states([op for op, _ in ops.values()]).values()) == {"succeeded"},
            60,
            "both operations succeed",
        )
        requests = sim_control.ledger()["requests"]
        for step, (op, order_id) in ops.items():
            (key,) = app.keys([op])
            assert app.path(op) == REAL_WORKER_KILLS[step], step
            assert sim_control.effects("acme", key) == 1, step
            assert sim_control.requests("acme", key) == 1, step
            # through the provider: a wire-protocol request would have carried its
            # Settled-Deadline (Stripe's lookup lists the order's refunds: while it has none,
            # the lookup is counted against the order)
            looked_up = order_id if (mode, step) == ("stripe", "after_claim") else key
            rows = [r for r in requests if r["idempotency_key"] in {key, looked_up}]
            assert sorted((r["idempotency_key"], r["phase"]) for r in rows) == sorted(
                {(key, "submit"), (looked_up, "lookup")}
            ), step
            assert [r["last_deadline"] for r in rows] == [None, None], step
        check_truthful(app.sessions, sim_control)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop_all()
        app.close()


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("provider_rig", PROVIDERS, indirect=True)
def test_an_unknown_send_is_settled_by_a_same_key_resend_in_provider_mode(
    provider_rig: Rig,
) -> None:
    """The provider's default contract has no fence and a 5-minute delay bound: a "not found"
    proves nothing for minutes. Sent again with the same key through the provider's own
    gateway, the refund is made once and settles at the first pass."""
    rig = provider_rig
    rig.control.add_rule("reset_before", times=1)
    op = rig.enqueue_on_its_own_order("op-resend")
    assert rig.executor().execute([op]) == {op: State.UNKNOWN}
    report = rig.reconciler(resender=rig.executor(worker="w2")).run_once()
    assert report.outcomes == {"resent": 1}
    assert rig.op(op).state == "succeeded"
    assert rig.effects(op) == 1 and rig.sends(op) == 2
