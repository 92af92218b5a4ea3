"""Retry by time within the deadline: a downstream that refuses connections costs latency, not
the refund (finding 1 of issue 28), through the wire protocol and the Stripe gateway alike; the
attempt budget counts only attempts that reached the downstream; a give-up says its true stop
in the run's report and the operation's status.

The executor runs against the simulator through the TCP fault proxy (a real refused
connection: the proxy stops listening), on PostgreSQL and SQLite.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from outbox.kinds import default_registry
from outbox.models import OperationEvent
from outbox.runs import open_run, operation_status, run_report
from outbox.states import State
from settled.simulator.proxy import FaultProxy
from tests.support.rig import GOOD, Rig
from workers.executor import Executor

#: more tries than the old budget of 5 would have allowed
TRIES = 8


@pytest.fixture(params=["wire", "stripe"])
def any_rig(request: pytest.FixtureRequest, rig: Rig) -> Rig:
    """The rig speaking the wire protocol, or Stripe (the Stripe gateway, the SDK), as
    ``stripe_rig`` makes it."""
    if request.param == "stripe":
        rig.stripe = True
        rig.outbox = replace(rig.outbox, registry=default_registry())
    return rig


def refused_tries(rig: Rig, executor: Executor, op_id: int, n: int) -> None:
    """``n`` tries of the operation, each due at once, each refused (the proxy refuses)."""
    for attempt in range(1, n + 1):
        rig.make_due(op_id)
        assert executor.execute([op_id]) == {op_id: State.PLANNED}, attempt


def give_up_evidence(rig: Rig, op_id: int) -> dict[str, object]:
    with rig.sessions() as s:
        rows = s.scalars(
            select(OperationEvent.evidence)
            .where(OperationEvent.operation_id == op_id, OperationEvent.to_state == "rejected")
            .order_by(OperationEvent.id)
        ).all()
    assert len(rows) == 1
    return dict(rows[0] or {})


def test_refused_connections_for_more_tries_than_the_budget_do_not_reject_the_refund(
    any_rig: Rig, sim_proxy: FaultProxy
) -> None:
    """Finding 1: five refused connections in a few seconds rejected a refund for good, an
    hour before its deadline. Tries that never left cost none of its 5 attempts."""
    rig = any_rig
    op_id = rig.enqueue()  # max_attempts 5, deadline an hour away
    executor = rig.executor(url=sim_proxy.url)
    sim_proxy.refuse()
    refused_tries(rig, executor, op_id, TRIES)
    op = rig.op(op_id)
    assert (op.state, op.reason, op.attempts) == ("planned", None, TRIES)
    assert [a.proof for a in rig.attempts(op_id)] == ["not_sent"] * TRIES
    assert rig.sends(op_id) == 0  # nothing reached the downstream
    sim_proxy.passthrough()  # the service is back
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.SUCCEEDED}
    assert rig.effects(op_id) == 1


def test_no_network_for_the_stripe_gateway_is_tried_by_time_until_the_deadline(
    stripe_rig: Rig,
) -> None:
    """No network at all (the Stripe API's name does not resolve): tried again and again,
    given up at the deadline only, and the report says so."""
    rig = stripe_rig
    with rig.sessions.begin() as s:
        run = open_run(s, tenant="acme")
        got = rig.outbox.enqueue(
            s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run
        )
        op_id, handle = got.operation.id, run.handle
    executor = rig.executor(url="http://api.stripe.invalid")
    refused_tries(rig, executor, op_id, TRIES)
    assert [a.detail["phase"] for a in rig.attempts(op_id)] == ["resolve"] * TRIES
    rig.set(op_id, deadline=datetime.now(UTC) - timedelta(seconds=1))
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.REJECTED}
    op = rig.op(op_id)
    assert (op.reason, op.attempts) == ("not_executed", TRIES)
    evidence = give_up_evidence(rig, op_id)
    assert (evidence["stop"], evidence["tries"], evidence["reached"]) == (
        "deadline_passed",
        TRIES,
        0,
    )
    with rig.sessions() as s:
        text = run_report(s, "acme", handle).as_dict("en")["not_done"][0]["text"]
    assert text.startswith(
        "Operation op-1 (refund of 100.00 CNY) was not done: "
        f"gave up at its deadline after {TRIES} tries"
    )
    assert text.endswith("(the service could not be reached).")


def test_the_attempt_budget_counts_only_attempts_that_reached_the_downstream(
    rig: Rig, sim_proxy: FaultProxy
) -> None:
    registry = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    op_id = rig.enqueue(max_attempts=2)
    executor = rig.executor(registry, url=sim_proxy.url)
    sim_proxy.refuse()
    refused_tries(rig, executor, op_id, 3)
    sim_proxy.passthrough()
    rig.control.add_rule("503_before")  # reaches the service, refused before processing
    refused_tries(rig, executor, op_id, 1)
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.REJECTED}  # the second that reached it
    op = rig.op(op_id)
    assert (op.reason, op.attempts) == ("not_executed", 5)
    assert [a.proof for a in rig.attempts(op_id)] == ["not_sent"] * 3 + ["not_executed"] * 2
    assert rig.sends(op_id) == 2
    assert rig.effects(op_id) == 0
    assert give_up_evidence(rig, op_id) == {"stop": "attempts_exhausted", "tries": 5, "reached": 2}
    # nothing more is sent for it, whatever hint comes
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {}
    assert rig.sends(op_id) == 2


def test_the_operation_status_says_the_true_stop_in_both_languages(
    rig: Rig, sim_proxy: FaultProxy
) -> None:
    with rig.sessions.begin() as s:
        run = open_run(s, tenant="acme")
        got = rig.outbox.enqueue(
            s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run
        )
        op_id, handle = got.operation.id, run.handle
    executor = rig.executor(url=sim_proxy.url)
    sim_proxy.refuse()
    refused_tries(rig, executor, op_id, 9)
    # fourteen minutes of tries (the test makes time pass: no sleeping)
    rig.age_attempts(op_id, 14 * 60)
    rig.set(op_id, deadline=datetime.now(UTC) - timedelta(seconds=1))
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.REJECTED}
    with rig.sessions() as s:
        status = operation_status(s, "acme", "op-1")
        report = run_report(s, "acme", handle)
    assert (status["state"], status["evidence"]["stop"], status["evidence"]["tries"]) == (
        "rejected",
        "deadline_passed",
        9,
    )
    assert status["evidence"]["cause"] == "refused"
    assert report.as_dict("en")["not_done"][0]["text"] == (
        "Operation op-1 (refund of 100.00 CNY) was not done: "
        "gave up at its deadline after 9 tries over 14 min "
        "(the service refused connections)."
    )
    assert report.as_dict("zh")["not_done"][0]["text"] == (
        "操作 op-1（refund，100.00 CNY）未完成：已到截止时间，放弃重试：共尝试 9 次，历时 14 分钟"
        "（对方服务拒绝连接）。"
    )
    assert "not carried out in time" not in report.as_dict("en")["text"]


def test_the_ceiling_on_tries_ends_a_retry_that_never_reaches_anything(
    rig: Rig, sim_proxy: FaultProxy
) -> None:
    op_id = rig.enqueue()
    executor = rig.executor(url=sim_proxy.url, max_tries=4)
    sim_proxy.refuse()
    refused_tries(rig, executor, op_id, 3)
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {op_id: State.REJECTED}  # the fourth, refused too
    assert give_up_evidence(rig, op_id) == {"stop": "tries_exhausted", "tries": 4, "reached": 0}
    rig.make_due(op_id)
    assert executor.execute([op_id]) == {}
    assert len(rig.attempts(op_id)) == 4
