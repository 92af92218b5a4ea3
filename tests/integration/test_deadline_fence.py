"""A request that lands after its attempt: through the real executor and reconciler against the
simulator, a proxy holding the request's bytes past its deadline (a proxy's queue, a slow path).

With the fence (the simulator refuses a request that arrives after its ``Settled-Deadline``, and
the contract says so) the late request has no effect, and the operation is sent again with the
same key once its lease is over. Without it (the switch off, the contract without the fence) a
"not found" proves nothing until the declared delay bound has passed too, so the late request
is found, never contradicted. The judge is the simulator's ledger (and the rig's
``check_truthful`` at the end of each test).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, timedelta

import pytest

from outbox.kinds import default_registry
from outbox.models import Operation, OperationEvent
from outbox.states import State
from settled.simulator import SimulatorHandle
from settled.simulator.proxy import FaultProxy
from support.operation_view import report_words
from tests.support.rig import Rig
from tests.support.simtools import wait_until

#: The executor's lease and clock margin: each attempt's deadline is 2 s after its claim.
LEASE, MARGIN = 3.0, 1.0


@pytest.fixture
def proxy(simulator: SimulatorHandle) -> Iterator[FaultProxy]:
    with FaultProxy(simulator.host, simulator.port) as proxy:
        yield proxy


def send_held(rig: Rig, proxy: FaultProxy, op: int, **executor: object) -> None:
    """One attempt whose request the proxy holds until its client gave up (at its deadline),
    then delivers: it lands after its deadline."""
    proxy.hold_requests()
    rig.executor(url=proxy.url, lease_seconds=LEASE, clock_margin=MARGIN, **executor).execute([op])
    assert rig.op(op).state == State.UNKNOWN  # the client heard nothing in time
    assert rig.sends(op) == 0  # still held
    # The client gives up by its own reading of the database's clock, which may run up to a
    # database round trip ahead of it (a loaded machine): release only once the attempt's lease
    # is over by the clock the simulator reads, so the request surely lands past its deadline.
    (attempt,) = rig.attempts(op)
    assert attempt.not_after is not None
    lease_end = attempt.not_after.replace(tzinfo=attempt.not_after.tzinfo or UTC).timestamp()
    wait_until(lambda: time.time() > lease_end, 10, "the attempt's lease to end")
    proxy.release()
    wait_until(lambda: proxy.answered == 1, 10, "the late request answered")


def requeue_evidence(rig: Rig, op: int) -> dict[str, object]:
    with rig.sessions() as s:
        events = s.query(OperationEvent).filter_by(operation_id=op, to_state="planned").all()
    (requeue,) = [e for e in events if e.from_state == "unknown"]
    return dict(requeue.evidence or {})


def test_a_request_landing_after_its_deadline_has_no_effect_and_is_sent_again(
    rig: Rig, proxy: FaultProxy
) -> None:
    op = rig.enqueue()
    key = rig.op(op).idempotency_key
    send_held(rig, proxy, op)
    # It reached the downstream after its deadline: refused, before any effect.
    assert rig.sends(op) == 1 and rig.effects(op) == 0
    assert rig.control.injected() == {}  # no fault did this: the fence did
    rig.age_attempts(op, 60)  # past the lease end and the processing time
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    assert requeue_evidence(rig, op)["rests_on"] == "deadline_fence"
    # Not done yet, and the words say what that rests on (the run report's, the console's).
    with rig.sessions() as s:
        words = report_words(s, s.get(Operation, op))
    assert words["group"] == "not_done"
    assert words["text"]["en"].endswith(
        "This rests on the service refusing any request that arrives past its deadline."
    )
    assert words["text"]["zh"].endswith("此结论的依据：对方服务拒绝超过截止时间才到达的请求。")
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.op(op).idempotency_key == key
    assert (rig.sends(op), rig.effects(op)) == (2, 1)


def test_the_fences_answer_heard_in_time_is_not_executed_and_sent_again(rig: Rig) -> None:
    """The downstream's clock ahead of ours: it refuses the request while its client still
    waits; the executor hears "not executed" and sends again, same key, next attempt."""
    rig.control.advance_clock(3600)
    op = rig.enqueue()
    key = rig.op(op).idempotency_key
    assert rig.executor().execute([op]) == {op: State.PLANNED}
    assert rig.attempts(op)[0].status_code == 408
    assert rig.effects(op) == 0
    rig.control.advance_clock(-3600)
    rig.make_due(op)
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.op(op).idempotency_key == key
    assert (rig.sends(op), rig.effects(op)) == (2, 1)


def test_the_fences_answer_from_a_downstream_that_does_not_promise_it_goes_to_a_person(
    rig: Rig,
) -> None:
    rig.control.advance_clock(3600)
    op = rig.enqueue()
    assert rig.executor(registry=default_registry()).execute([op]) == {op: State.UNKNOWN}
    assert [r.reason for r in rig.reviews(op)] == ["unexpected_response"]
    assert rig.effects(op) == 0


def test_without_the_fence_a_not_found_waits_out_the_delay_bound_and_the_late_request_is_found(
    rig: Rig, proxy: FaultProxy
) -> None:
    """The late request executes. A "not found" asked before it landed, past the lease end
    and the processing time but inside the delay bound, must not send the operation back:
    with one attempt allowed it would end "rejected" while the refund lands."""
    rig.control.set_switches(deadline_fence=False)
    registry = default_registry().with_contract("refund", max_request_delay=timedelta(seconds=60))
    rig.outbox = replace(rig.outbox, registry=registry)
    op = rig.enqueue(max_attempts=1)
    proxy.hold_requests()
    rig.executor(url=proxy.url, lease_seconds=LEASE, clock_margin=MARGIN).execute([op])
    assert rig.op(op).state == State.UNKNOWN
    # 30 s later: past lease end + processing time (2 s), inside the delay bound (60 s).
    rig.age_attempts(op, 30)
    assert rig.reconciler().run_once().outcomes == {"wait_quiescence": 1}
    assert rig.op(op).state == State.UNKNOWN
    assert rig.executor().execute([op]) == {}  # nothing to send: still uncertain
    proxy.release()
    wait_until(lambda: proxy.answered == 1, 10, "the late request answered")
    assert rig.effects(op) == 1  # it landed
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == State.SUCCEEDED
    assert (rig.sends(op), rig.effects(op)) == (1, 1)
