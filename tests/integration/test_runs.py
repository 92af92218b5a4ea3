"""Runs against a real database (PostgreSQL and SQLite) and the simulator: cancel with
operations in every state, the report, and the report after the reconciler settles."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox import runs
from outbox.errors import InvalidInput, NotFound, StaleLease
from outbox.models import Operation, OperationEvent, Run
from outbox.report_lines import Group
from outbox.states import State
from tests.support.contend import contender, pausing
from tests.support.rig import GOOD, Rig, start_attempt


def refund(amount: int) -> dict[str, Any]:
    return {**GOOD, "amount_minor": amount}


def open_run(rig: Rig, tenant: str = "acme") -> tuple[int, str]:
    with rig.sessions.begin() as s:
        run = runs.open_run(s, tenant=tenant, title="refund two orders")
        return run.id, run.handle


def enqueue(rig: Rig, handle: str, op_id: str, params: dict[str, Any]) -> int:
    with rig.sessions.begin() as s:
        run = runs.find_run(s, "acme", handle)
        got = rig.outbox.enqueue(
            s, tenant="acme", op_id=op_id, kind="refund", params=params, run=run
        )
        return got.operation.id


def events(rig: Rig, op: int) -> list[tuple[Any, ...]]:
    with rig.sessions() as s:
        rows = s.execute(
            select(
                OperationEvent.from_state,
                OperationEvent.to_state,
                OperationEvent.actor,
                OperationEvent.reason,
            )
            .where(OperationEvent.operation_id == op)
            .order_by(OperationEvent.id)
        ).all()
    return [tuple(r) for r in rows]


def report(rig: Rig, handle: str) -> Any:
    with rig.sessions() as s:
        return runs.run_report(s, "acme", handle)


def submitted_by_a_lost_worker(rig: Rig, op: int) -> None:
    """Claimed and marked submitted, then the worker vanished before recording anything."""
    rig.start_send(op, worker="w-lost")


def test_cancel_with_operations_in_every_state_then_the_reconciler_settles(rig: Rig) -> None:
    _, handle = open_run(rig)
    ok = enqueue(rig, handle, "op-ok", refund(1000))
    no = enqueue(rig, handle, "op-no", refund(10**9))  # beyond the charged amount
    lost = enqueue(rig, handle, "op-lost", refund(2000))
    sub = enqueue(rig, handle, "op-sub", refund(3000))
    later = enqueue(rig, handle, "op-later", refund(4000))
    rig.control.add_rule("commit_then_reset", pattern=rig.op(lost).idempotency_key, times=1)
    executor = rig.executor()
    assert executor.execute([ok, no, lost]) == {
        ok: State.SUCCEEDED,
        no: State.REJECTED,
        lost: State.UNKNOWN,
    }
    submitted_by_a_lost_worker(rig, sub)
    before = {op: rig.op(op).lease_version for op in (ok, no, lost, sub, later)}

    with rig.sessions.begin() as s:
        done = runs.cancel_run(s, "acme", handle, actor="user:42")
    assert (list(done.cancelled_ids), done.already_requested) == ([later], False)

    states = {op: rig.op(op).state for op in (ok, no, lost, sub, later)}
    assert states == {
        ok: "succeeded",
        no: "rejected",
        lost: "unknown",
        sub: "submitted",
        later: "cancelled",
    }
    assert rig.op(later).lease_version == before[later] + 1
    assert all(rig.op(op).lease_version == before[op] for op in (ok, no, lost, sub))
    assert events(rig, later)[-1] == ("planned", "cancelled", "user:42", "run_cancelled")
    with rig.sessions() as s:
        run = s.scalar(select(Run).where(Run.handle == handle))
        assert run is not None
        assert run.cancelled_by == "user:42" and run.cancel_requested_at is not None
    # The cancelled operation is never sent, whatever hints still arrive.
    assert executor.execute([later]) == {}
    assert rig.sends(later) == 0

    rep = report(rig, handle)
    assert rep.cancelled
    assert [line.op_id for line in rep.group(Group.DONE)] == ["op-ok"]
    assert [line.op_id for line in rep.group(Group.NOT_DONE)] == ["op-no", "op-later"]
    assert [line.op_id for line in rep.group(Group.UNCERTAIN)] == ["op-lost", "op-sub"]
    assert rep.line("op-ok").evidence["reference"] == rig.op(ok).downstream_ref
    assert rep.line("op-no").evidence["reason"] == "business_rejected"
    assert rep.line("op-no").evidence["code"] == "amount_exceeds_refundable"
    en, zh = rep.as_dict("en")["text"], rep.as_dict("zh")["text"]
    for op_id, amount in (("op-lost", "20.00 CNY"), ("op-sub", "30.00 CNY")):
        assert (
            f"Stopped further processing, but the result of operation {op_id} (refund of "
            f"{amount}) is still pending confirmation." in en
        )
        assert f"已停止继续处理，但操作 {op_id}（refund，{amount}）的结果仍待确认。" in zh
    assert "Operation op-later (refund of 40.00 CNY) was cancelled before it was sent." in en

    # The reconciler looks the lost one up: it did happen.
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(lost).state == "succeeded"
    assert rig.effects(lost) == 1
    rep = report(rig, handle)
    assert [line.op_id for line in rep.group(Group.DONE)] == ["op-ok", "op-lost"]
    assert [line.op_id for line in rep.group(Group.UNCERTAIN)] == ["op-sub"]
    en = rep.as_dict("en")["text"]
    assert (
        f"Operation op-lost (refund of 20.00 CNY) is done (receipt {rig.op(lost).downstream_ref})."
        in en
    )
    assert "result of operation op-lost" not in en
    assert "已停止继续处理，但操作 op-lost" not in rep.as_dict("zh")["text"]


def test_cancel_holds_when_another_transaction_commits_between_its_read_and_its_write(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel reads the run, then writes; another user's task opens its run in between.
    On SQLite a deferred transaction failed there ("database is locked" at once, the busy
    timeout never applied); the cancel must give its answer, the other write wait its turn."""
    _, handle = open_run(rig)
    later = enqueue(rig, handle, "op-later", refund(1000))
    with contender(lambda: open_run(rig)) as other:
        pausing(monkeypatch, runs, "request_run_cancel", other)
        with rig.sessions.begin() as s:
            done = runs.cancel_run(s, "acme", handle, actor="user:42")
        other_id, _ = other.result()
    assert (list(done.cancelled_ids), done.already_requested) == ([later], False)
    assert rig.op(later).state == "cancelled" and rig.sends(later) == 0
    with rig.sessions() as s:
        assert s.get(Run, other_id) is not None


def test_a_claim_taken_before_the_cancel_is_fenced(rig: Rig) -> None:
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    claimed = rig.claim(op, worker="w-slow")
    with rig.sessions.begin() as s:
        assert list(runs.cancel_run(s, "acme", handle, actor="user:1").cancelled_ids) == [op]
    with pytest.raises(StaleLease), rig.sessions.begin() as s:
        start_attempt(rig.storage, s, claimed, worker="w-slow")
    assert rig.op(op).state == "cancelled"
    assert rig.attempts(op) == []
    assert rig.sends(op) == 0


def test_cancel_twice_is_harmless_and_keeps_the_first_actor(rig: Rig) -> None:
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    with rig.sessions.begin() as s:
        runs.cancel_run(s, "acme", handle, actor="user:1")
    with rig.sessions.begin() as s:
        again = runs.cancel_run(s, "acme", handle, actor="user:2")
    assert (list(again.cancelled_ids), again.already_requested) == ([], True)
    assert [e for e in events(rig, op) if e[1] == "cancelled"] == [
        ("planned", "cancelled", "user:1", "run_cancelled")
    ]
    with rig.sessions() as s:
        assert s.scalar(select(Run.cancelled_by).where(Run.handle == handle)) == "user:1"


def test_another_tenants_handle_is_not_found_and_cancels_nothing(rig: Rig) -> None:
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    with rig.sessions.begin() as s:
        with pytest.raises(NotFound) as other:
            runs.cancel_run(s, "globex", handle, actor="user:1")
        with pytest.raises(NotFound) as made_up:
            runs.cancel_run(s, "acme", runs.new_handle(), actor="user:1")
        with pytest.raises(NotFound):
            runs.run_report(s, "globex", handle)
    assert other.value.as_dict() == made_up.value.as_dict()
    assert rig.op(op).state == "planned"
    with rig.sessions() as s:
        assert s.scalar(select(Run.cancel_requested_at).where(Run.handle == handle)) is None


@pytest.mark.parametrize(
    ("tenant", "title", "code"),
    [("Not A Tenant", None, "invalid_tenant"), ("acme", "", "invalid_title"),
     ("acme", "x" * 201, "invalid_title")],
)  # fmt: skip
def test_bad_input_opens_no_run(rig: Rig, tenant: str, title: str | None, code: str) -> None:
    with rig.sessions.begin() as s, pytest.raises(InvalidInput) as err:
        runs.open_run(s, tenant=tenant, title=title)
    assert err.value.code == code
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0


def test_bad_actor_cancels_nothing(rig: Rig) -> None:
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    with rig.sessions.begin() as s, pytest.raises(InvalidInput):
        runs.cancel_run(s, "acme", handle, actor="")
    assert rig.op(op).state == "planned"


def test_handles_are_opaque_and_distinct(rig: Rig) -> None:
    handles = {open_run(rig)[1] for _ in range(20)}
    assert len(handles) == 20
    assert all(runs.HANDLE_RE.fullmatch(h) for h in handles)


def test_compensation_is_refused_in_a_cancelled_run_and_for_operations_with_no_effect(
    rig: Rig,
) -> None:
    _, handle = open_run(rig)
    ok = enqueue(rig, handle, "op-ok", refund(1000))
    no = enqueue(rig, handle, "op-no", refund(10**9))
    rig.executor().execute([ok, no])
    with rig.sessions.begin() as s:
        rejected = s.get(Operation, no)
        assert rejected is not None
        with pytest.raises(InvalidInput) as err:
            runs.compensate(rig.outbox, s, rejected, op_id="op-c", kind="refund",
                            params=refund(1))  # fmt: skip
        assert err.value.code == "nothing_to_compensate"
    with rig.sessions.begin() as s:
        runs.cancel_run(s, "acme", handle, actor="user:1")
    with rig.sessions.begin() as s:
        done = s.get(Operation, ok)
        assert done is not None
        with pytest.raises(InvalidInput) as err:
            runs.compensate(rig.outbox, s, done, op_id="op-c", kind="refund", params=refund(1))
        assert err.value.code == "run_cancelled"
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Operation)) == 2


def test_operation_status_is_scoped_by_tenant(rig: Rig) -> None:
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    rig.executor().execute([op])
    with rig.sessions() as s:
        status = runs.operation_status(s, "acme", "op-1")
        assert (status["state"], status["group"], status["run"]) == ("succeeded", "done", handle)
        assert status["evidence"]["reference"] == rig.op(op).downstream_ref
        with pytest.raises(NotFound):
            runs.operation_status(s, "globex", "op-1")


def test_deferred_operation_is_cancelled_not_sent_again(rig: Rig) -> None:
    """Provably not sent (429), waiting for its retry: cancel stops it."""
    _, handle = open_run(rig)
    op = enqueue(rig, handle, "op-1", refund(1000))
    rig.control.add_rule("429", retry_after="30", times=1)
    assert rig.executor().execute([op]) == {op: State.PLANNED}
    with rig.sessions.begin() as s:
        runs.cancel_run(s, "acme", handle, actor="user:1")
    rig.set(op, next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))
    assert rig.executor().execute([op]) == {}
    assert rig.op(op).state == "cancelled"
    assert rig.sends(op) == 1 and rig.effects(op) == 0
