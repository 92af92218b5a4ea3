"""Two identical agent requests at the same instant make one proposal, never two.

The repeat check is a read before an insert; without a lock, both requests would find no repeat,
both would be added, and a tenant policy would approve both: two refunds from one regenerated
tool call. ``Storage.serialize`` makes the second request wait for the first's transaction.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.intake import Outbox
from outbox.models import Proposal
from outbox.outage import DatabaseOutage
from outbox.proposals import Proposals, Proposed
from outbox.settings import Settings
from tests.support.rig import GOOD
from tests.support.services import wait_until
from workers.sweeper import expire_proposals


def _propose(proposals: Proposals, session: Session, call: str) -> Proposed:
    return proposals.propose(
        session, tenant="acme", kind="refund", params=GOOD, reason="damaged", correlation_id=call
    )


def _waiting_on_a_lock(engine: Engine) -> bool:
    if engine.dialect.name != "postgresql":
        return True  # SQLite: the second writer waits in its busy handler; nothing to see
    with engine.connect() as conn:
        waiting = conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        ).scalar_one()
    return bool(waiting)


def test_two_identical_requests_at_once_make_one_proposal(engine: Engine, outbox: Outbox) -> None:
    proposals = Proposals(outbox, timedelta(hours=1))
    second: Future[tuple[bool, str]] = Future()

    def request_again() -> None:
        try:
            with Session(engine) as s, s.begin():
                again = _propose(proposals, s, "call-2")
                second.set_result((again.created, again.proposal.handle))
        except BaseException as exc:
            second.set_exception(exc)

    with Session(engine) as s, s.begin():
        first = _propose(proposals, s, "call-1")
        handle = first.proposal.handle
        racer = threading.Thread(target=request_again)
        racer.start()
        # The second request is waiting on the first's lock before the first commits.
        assert wait_until(lambda: _waiting_on_a_lock(engine) or second.done(), timeout=30)
        assert not second.done(), "the second request did not wait for the first"
    racer.join(timeout=30)
    created, again = second.result(timeout=0)
    assert first.created
    assert not created
    assert again == handle
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Proposal)) == 1


def test_the_sweepers_expiry_marks_only_undecided_proposals_past_their_time_to_live(
    engine: Engine, outbox: Outbox
) -> None:
    proposals = Proposals(outbox, timedelta(hours=1), ttl=timedelta(minutes=30))
    sessions = sessionmaker(engine, expire_on_commit=False)
    handles = {}
    with sessions.begin() as s:
        for order in ("old", "young", "approved", "declined"):
            params = {**GOOD, "order_id": order}
            got = proposals.propose(s, tenant="acme", kind="refund", params=params, reason="r")
            handles[order] = got.proposal.handle
        proposals.approve(s, "acme", handles["approved"], by="staff:mei")
        proposals.decline(s, "acme", handles["declined"], by="staff:mei")
    with sessions.begin() as s:
        long_ago = datetime.now(UTC) - timedelta(hours=2)
        aged = ("old", "approved", "declined")
        s.execute(
            update(Proposal)
            .where(Proposal.handle.in_([handles[o] for o in aged]))
            .values(created_at=long_ago)
        )
    assert expire_proposals(sessions, proposals.ttl) == 1
    assert expire_proposals(sessions, proposals.ttl) == 0  # once only
    with sessions() as s:
        status = {o: proposals.find(s, "acme", h).status for o, h in handles.items()}
        assert [p.handle for p in proposals.waiting(s)] == [handles["young"]]
    assert status == {
        "old": "expired",
        "young": "proposed",
        "approved": "approved",
        "declined": "declined",
    }


def test_the_sweep_task_rehints_due_operations_even_when_expiry_fails(
    engine: Engine,
    outbox: Outbox,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from settled import celery_app

    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        due = outbox.enqueue(s, tenant="acme", op_id="op-due", kind="refund", params=GOOD)
    hints: list[list[int]] = []

    def expiry_fails(*_: object) -> int:
        raise RuntimeError("the proposals table is locked")

    runtime = SimpleNamespace(sessions=sessions, outage=DatabaseOutage())
    monkeypatch.setattr(celery_app, "runtime", lambda settings: runtime)
    monkeypatch.setattr(celery_app, "expire_proposals", expiry_fails)
    app = celery_app.create_app(Settings())
    monkeypatch.setattr(app, "send_task", lambda name, args, queue: hints.append(args[0]))
    app.tasks[celery_app.SWEEP].run()
    assert hints == [[due.operation.id]]  # the lost-hint safety net still ran
    assert "proposal expiry failed" in caplog.text
