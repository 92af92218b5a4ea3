"""The after-sales example end to end against the simulator, through executor and reconciler.

A ticket is created, scheduling the pickup fails; either a compensation cancels the ticket
(succeeding, failing, or ending unknown), or the app keeps the ticket and schedules another
pickup. The report never says "restored" without the compensation's receipt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox import runs
from outbox.errors import IdempotencyConflict, InvalidInput
from outbox.intake import Enqueued
from outbox.models import Operation
from outbox.report import Report
from outbox.report_lines import Compensation, Group
from outbox.states import State
from tests.support.rig import HOLD, Rig

TICKET = {"ticket_id": "T-1", "order_id": "A1042", "reason": "damaged"}
PICKUP = {"ticket_id": "T-1", "day": "2026-03-02", "slot": "morning"}
CANCEL = {"ticket_id": "T-1", "reason": "pickup_failed"}


@dataclass
class Flow:
    handle: str
    ticket: int
    pickup: int


def enqueue(rig: Rig, handle: str, op_id: str, kind: str, params: dict[str, Any]) -> int:
    with rig.sessions.begin() as s:
        run = runs.find_run(s, "acme", handle)
        return rig.outbox.enqueue(
            s, tenant="acme", op_id=op_id, kind=kind, params=params, run=run
        ).operation.id


def ticket_then_failed_pickup(rig: Rig) -> Flow:
    with rig.sessions.begin() as s:
        handle = runs.open_run(s, tenant="acme", title="return a damaged item").handle
    ticket = enqueue(rig, handle, "op-ticket", "after_sales_ticket", TICKET)
    pickup = enqueue(rig, handle, "op-pickup", "pickup", PICKUP)
    rig.control.add_rule("business_reject", kind="pickup", code="no_courier", times=1)
    executor = rig.executor()
    assert executor.execute([ticket]) == {ticket: State.SUCCEEDED}
    assert executor.execute([pickup]) == {pickup: State.REJECTED}
    return Flow(handle, ticket, pickup)


def compensate(rig: Rig, flow: Flow) -> int:
    with rig.sessions.begin() as s:
        original = s.get(Operation, flow.ticket)
        assert original is not None
        got = runs.compensate(
            rig.outbox, s, original, op_id="op-undo", kind="ticket_cancel", params=CANCEL
        )
        assert got.created
        assert got.operation.run_id == original.run_id
        assert got.operation.compensates_id == original.id
        assert got.operation.fingerprint != original.fingerprint
        return got.operation.id


def report(rig: Rig, handle: str) -> Report:
    with rig.sessions() as s:
        return runs.run_report(s, "acme", handle)


def texts(rep: Report) -> tuple[str, str]:
    return rep.as_dict("en")["text"], rep.as_dict("zh")["text"]


def ticket_status(rig: Rig) -> str:
    (ticket,) = [t for t in rig.control.ledger()["tickets"] if t["ticket_id"] == "T-1"]
    return str(ticket["status"])


def assert_failed_pickup(rep: Report) -> None:
    line = rep.line("op-pickup")
    assert line.group is Group.NOT_DONE
    assert line.evidence["reason"] == "business_rejected"
    assert line.evidence["code"] == "no_courier"


def test_compensation_succeeds_and_the_report_says_restored_with_its_receipt(rig: Rig) -> None:
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)
    rep = report(rig, flow.handle)
    assert rep.line("op-ticket").compensation is not None
    assert rep.line("op-ticket").compensation.status is Compensation.NOT_SENT  # type: ignore[union-attr]
    assert "restored" not in texts(rep)[0].lower()

    assert rig.executor().execute([undo]) == {undo: State.SUCCEEDED}
    receipt = rig.op(undo).downstream_ref
    assert receipt is not None and receipt.startswith("tcx_")
    assert ticket_status(rig) != "open"

    rep = report(rig, flow.handle)
    assert_failed_pickup(rep)
    note = rep.line("op-ticket").compensation
    assert note is not None
    assert (note.op_id, note.status, note.reference) == ("op-undo", Compensation.RESTORED, receipt)
    assert [line.op_id for line in rep.group(Group.DONE)] == ["op-ticket", "op-undo"]
    assert rep.group(Group.UNCERTAIN) == []
    en, zh = texts(rep)
    assert f"Restored by compensation op-undo (receipt {receipt})." in en
    assert f"已由补偿操作 op-undo 撤销，已恢复（回执 {receipt}）。" in zh


def test_compensation_fails_and_the_report_says_not_restored(rig: Rig) -> None:
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)
    rig.control.add_rule("business_reject", kind="ticket_cancel", code="ticket_locked")
    assert rig.executor().execute([undo]) == {undo: State.REJECTED}
    assert ticket_status(rig) == "open"  # the ticket is still there

    rep = report(rig, flow.handle)
    assert_failed_pickup(rep)
    note = rep.line("op-ticket").compensation
    assert note is not None and note.status is Compensation.NOT_DONE
    assert rep.line("op-ticket").group is Group.DONE
    assert rep.line("op-undo").group is Group.NOT_DONE
    assert rep.line("op-undo").evidence["code"] == "ticket_locked"
    en, zh = texts(rep)
    assert "restored" not in en.lower() and "已恢复" not in zh
    assert "Compensation op-undo was not done, so nothing has been reversed." in en
    assert "补偿操作 op-undo 未完成，原操作未被撤销。" in zh


def test_compensation_ends_unknown_then_the_reconciler_finds_it(rig: Rig) -> None:
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)
    rig.control.add_rule("commit_then_timeout", kind="ticket_cancel", times=1, hold_seconds=HOLD)
    assert rig.executor().execute([undo]) == {undo: State.UNKNOWN}
    rig.control.release_holds()

    rep = report(rig, flow.handle)
    note = rep.line("op-ticket").compensation
    assert note is not None and note.status is Compensation.PENDING
    assert [line.op_id for line in rep.group(Group.UNCERTAIN)] == ["op-undo"]
    en, zh = texts(rep)
    assert "restored" not in en.lower() and "已恢复" not in zh
    assert "Compensation op-undo is still pending confirmation." in en
    assert "补偿操作 op-undo 的结果仍待确认。" in zh

    # It did happen downstream: the lookup brings the receipt, and only now "restored".
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.effects(undo) == 1
    receipt = rig.op(undo).downstream_ref
    rep = report(rig, flow.handle)
    assert rep.line("op-ticket").compensation is not None
    assert rep.line("op-ticket").compensation.status is Compensation.RESTORED  # type: ignore[union-attr]
    assert f"Restored by compensation op-undo (receipt {receipt})." in texts(rep)[0]


def test_compensation_unknown_after_a_stop_is_reported_as_stopped_but_pending(
    rig: Rig,
) -> None:
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)
    rig.control.add_rule("commit_then_reset", kind="ticket_cancel", times=1)
    assert rig.executor().execute([undo]) == {undo: State.UNKNOWN}
    with rig.sessions.begin() as s:
        runs.cancel_run(s, "acme", flow.handle, actor="user:7")
    en, zh = texts(report(rig, flow.handle))
    assert (
        "Stopped further processing, but the result of operation op-undo (ticket_cancel) "
        "is still pending confirmation." in en
    )
    assert "已停止继续处理，但操作 op-undo（ticket_cancel）的结果仍待确认。" in zh
    assert "restored" not in en.lower() and "已恢复" not in zh


def test_keep_the_ticket_and_schedule_another_pickup(rig: Rig) -> None:
    flow = ticket_then_failed_pickup(rig)
    # Not a compensation: a new operation with a new op_id, same run.
    retry = enqueue(rig, flow.handle, "op-pickup-2", "pickup", {**PICKUP, "day": "2026-03-03"})
    assert rig.op(retry).idempotency_key != rig.op(flow.pickup).idempotency_key
    assert rig.executor().execute([retry]) == {retry: State.SUCCEEDED}
    assert ticket_status(rig) == "open"

    rep = report(rig, flow.handle)
    assert [line.op_id for line in rep.group(Group.DONE)] == ["op-ticket", "op-pickup-2"]
    assert [line.op_id for line in rep.group(Group.NOT_DONE)] == ["op-pickup"]
    assert rep.line("op-ticket").compensation is None
    assert rep.line("op-pickup-2").evidence["reference"].startswith("pu_")
    en, zh = texts(rep)
    assert "restored" not in en.lower() and "已恢复" not in zh
    assert "Operation op-pickup (pickup) was not done: refused by the service (no_courier)." in en
    assert "操作 op-pickup（pickup）未完成：被对方服务拒绝（no_courier）。" in zh


def test_replaying_a_compensation_returns_it_and_another_op_id_is_a_new_one(rig: Rig) -> None:
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)
    with rig.sessions.begin() as s:
        original = s.get(Operation, flow.ticket)
        assert original is not None
        again = runs.compensate(
            rig.outbox, s, original, op_id="op-undo", kind="ticket_cancel", params=CANCEL
        )
        assert (again.created, again.operation.id) == (False, undo)
        pickup = s.get(Operation, flow.pickup)
        assert pickup is not None
        with pytest.raises(IdempotencyConflict):
            runs.compensate(
                rig.outbox, s, original, op_id="op-pickup", kind="pickup", params=PICKUP
            )


def test_a_second_compensation_is_refused_until_the_first_is_refused_downstream(rig: Rig) -> None:
    """An operation is compensated once: a new op_id while a compensation may still undo it is
    refused (``already_compensated``, naming that one) and writes nothing; once that one was
    refused downstream (it undid nothing), another may be enqueued."""
    flow = ticket_then_failed_pickup(rig)
    undo = compensate(rig, flow)

    def again(op_id: str) -> Enqueued:
        with rig.sessions.begin() as s:
            original = s.get(Operation, flow.ticket)
            assert original is not None
            return runs.compensate(
                rig.outbox, s, original, op_id=op_id, kind="ticket_cancel", params=CANCEL
            )

    with pytest.raises(InvalidInput) as err:
        again("op-undo-2")
    assert err.value.code == "already_compensated"
    assert err.value.data["compensation"] == "op-undo"
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Operation)) == 3  # nothing written
    rig.control.add_rule("business_reject", kind="ticket_cancel", code="ticket_locked", times=1)
    assert rig.executor().execute([undo]) == {undo: State.REJECTED}
    second = again("op-undo-2")
    assert second.created and second.operation.compensates_id == flow.ticket
    assert rig.executor().execute([second.operation.id]) == {second.operation.id: State.SUCCEEDED}
    assert ticket_status(rig) != "open"
