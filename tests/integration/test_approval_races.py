"""The approval rules hold whoever writes first (PostgreSQL, where writers run at once).

Two rules read committed rows: the policy approves a refund by itself only if nothing else of
the kind is on the order, and an original is compensated once. The app writes in its own
transaction, which may stay open after ``enqueue``; without a lock the app's intake takes too,
an approval meanwhile reads past the app's uncommitted row and breaks the rule. Each test holds
one side's transaction open at an explicit pause, runs the other side in a thread, sees it wait
on the lock (``pg_locks``, polled with a deadline), then lets the first side finish. Judged by
the operations table and the simulator's ledger (and the rig's ``check_truthful`` at teardown).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from mcp import Client
from sqlalchemy import Engine, event, select, text
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import InvalidInput
from outbox.models import Operation
from outbox.proposals import Proposals
from outbox.runs import compensate
from outbox.storage.postgres import ORDER_LOCK_SPACE
from support.approvals import Approvals
from support.staff import Staff
from tests.integration.test_mcp_lifecycle import cancellations, ticket_done
from tests.support.agents import REFUND, call, converse, execute_all, operations, server
from tests.support.rig import GOOD, Rig
from tests.support.services import wait_until

ANN = Staff.parse("ann", "support")
CANCEL = {"reason": "duplicate"}
pytestmark = pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
WAITING = text(
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def waiting_for_a_lock(engine: Engine) -> bool:
    """Whether some transaction on this test's database (other sessions' tests share the
    server) waits for an advisory lock another one holds."""
    with engine.connect() as conn:
        return bool(conn.execute(WAITING).scalar_one())


class Background:
    """``work()`` in a thread: its result or error, and whether it has finished."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = work()
            except BaseException as exc:  # handed to the test, which asserts on it
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def waits_for_a_lock(self, engine: Engine) -> bool:
        """Whether it is waiting on a lock (False once it has finished without waiting)."""
        assert wait_until(lambda: self.done or waiting_for_a_lock(engine), timeout=30)
        return not self.done

    def join(self) -> Any:
        self.thread.join(timeout=30)
        assert self.done, "still running after 30 s"
        return self.result


def refunded_on(rig: Rig, order_id: str) -> list[int]:
    """The amounts the downstream refunded on ``order_id`` (its ledger)."""
    effects = rig.control.ledger()["effects"]
    return sorted(
        e["params"]["amount_minor"]
        for e in effects
        if e["kind"] == "refund" and e["params"]["order_id"] == order_id
    )


# -- (a) the app's own refund, not committed yet, keeps the policy from approving -----------


@pytest.mark.parametrize("app_commits", [True, False], ids=["app-commits", "app-rolls-back"])
def test_the_policy_waits_for_the_apps_open_refund_on_the_order_and_then_asks_a_person(
    rig: Rig, app_commits: bool
) -> None:
    """The app enqueues a refund on A1042 and has not committed; the agent asks for another on
    A1042 under a policy that would approve it alone. The approval waits for the app's
    transaction: committed, the refund is the first on the order and a person must approve the
    agent's; rolled back, there is none and the policy approves as for a first refund."""
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": 2000}))

    srv = server(rig, limits={"acme": 50000})  # a client without elicitation
    with rig.sessions() as app:
        app.begin()
        rig.outbox.enqueue(app, tenant="acme", op_id="op-app", kind="refund", params=GOOD)
        agent = Background(lambda: converse(srv, model))
        assert agent.waits_for_a_lock(rig.engine), "the policy did not wait for the app"
        app.commit() if app_commits else app.rollback()
    agent.join()
    assert agent.error is None
    execute_all(rig)
    if app_commits:
        assert seen[0]["error"]["kind"] == "pending"  # waits for a person
        assert [op.op_id for op in operations(rig)] == ["op-app"]
        assert refunded_on(rig, "A1042") == [10000]
    else:
        assert seen[0]["status"] == "approved" and seen[0]["decided_by"] == "policy:auto_approve"
        assert [op.params["amount_minor"] for op in operations(rig)] == [2000]
        assert refunded_on(rig, "A1042") == [2000]


def test_intake_holds_one_shared_order_lock_until_its_transaction_ends(rig: Rig) -> None:
    """The lock is taken by the intake INSERT itself: shared (two intakes on an order never
    wait for each other), once per order however many operations, none for a kind with no
    order, and gone when the app's transaction ends."""
    mine = text(
        "SELECT classid, mode FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    )
    with rig.sessions() as app:
        app.begin()
        for op_id, amount in (("op-1", 1000), ("op-2", 2000)):
            params = {**GOOD, "amount_minor": amount}
            rig.outbox.enqueue(app, tenant="acme", op_id=op_id, kind="refund", params=params)
        pickup = {"ticket_id": "T-1", "day": "2026-03-02", "slot": "morning"}
        rig.outbox.enqueue(app, tenant="acme", op_id="op-3", kind="pickup", params=pickup)
        assert app.execute(mine).all() == [(ORDER_LOCK_SPACE, "ShareLock")]
        app.rollback()
        assert app.execute(mine).all() == []
    assert operations(rig) == []


# -- (b) the app's compensate and staff approving the agent's compensation ------------------


@contextmanager
def paused_before_commit(sessions: sessionmaker[Session]) -> Iterator[tuple[threading.Event, ...]]:
    """Sessions of ``sessions`` stop just before their commit until ``resume`` is set:
    (``paused``, ``resume``)."""
    paused, resume = threading.Event(), threading.Event()

    def pause(_: Session) -> None:
        paused.set()
        assert resume.wait(timeout=30)

    event.listen(sessions, "before_commit", pause)
    try:
        yield paused, resume
    finally:
        resume.set()
        event.remove(sessions, "before_commit", pause)


def compensations(rig: Rig, original_id: int) -> list[Operation]:
    with rig.sessions() as s:
        stmt = select(Operation).where(Operation.compensates_id == original_id)
        return list(s.scalars(stmt.order_by(Operation.id)))


def waiting_compensation_request(rig: Rig) -> tuple[Operation, int, dict[str, Any]]:
    """An after-sales ticket done through an agent's approved request, and that agent's
    request to compensate it, waiting for staff: (the original operation, the request's id,
    the ticket as the tool answered)."""
    ticket = ticket_done(rig)
    asked: list[dict[str, Any]] = []

    async def ask(client: Client) -> None:  # no elicitation: it waits for staff
        got = await call(client, "request_compensation", handle=ticket["handle"], reason="x")
        asked.append(got)

    converse(server(rig), ask)
    assert asked[0]["error"]["kind"] == "pending"
    with rig.sessions() as s:
        original = s.scalars(select(Operation).where(Operation.op_id == ticket["op_id"])).one()
        request = Proposals(rig.outbox).find(s, "acme", asked[0]["error"]["handle"])
        return original, request.id, ticket


def app_compensates(rig: Rig, original: Operation, session: Session) -> Operation:
    got = compensate(
        rig.outbox,
        session,
        original,
        op_id="op-app-undo",
        kind="ticket_cancel",
        params={"ticket_id": original.params["ticket_id"], **CANCEL},
    )
    return got.operation


def test_staff_approval_waits_for_the_apps_open_compensation_and_is_refused(rig: Rig) -> None:
    """The app compensates the ticket and has not committed; staff approve the agent's request
    to compensate it: the approval waits, then is refused (``already_compensated``), and the
    ticket is cancelled once."""
    original, request_id, ticket = waiting_compensation_request(rig)
    approvals = Approvals(rig.sessions, Proposals(rig.outbox, timedelta(hours=1)))
    with rig.sessions() as app:
        app.begin()
        mine = app_compensates(rig, app.get(Operation, original.id) or original, app)
        staff = Background(lambda: approvals.approve(ANN, request_id))
        assert staff.waits_for_a_lock(rig.engine), "the approval did not wait for the app"
        app.commit()
    staff.join()
    assert isinstance(staff.error, InvalidInput) and staff.error.code == "already_compensated"
    assert [c.op_id for c in compensations(rig, original.id)] == [mine.op_id]
    assert approvals.show(ANN, request_id)["status"] == "proposed"  # nothing was approved
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1


def test_the_apps_compensation_waits_for_a_staff_approval_and_is_refused(rig: Rig) -> None:
    """Staff approve the agent's request to compensate the ticket and have not committed; the
    app compensates it meanwhile: the app's compensate waits, then is refused
    (``already_compensated``, naming the approved compensation), and the ticket is cancelled
    once."""
    original, request_id, ticket = waiting_compensation_request(rig)
    sessions = sessionmaker(rig.engine, expire_on_commit=False)
    approvals = Approvals(sessions, Proposals(rig.outbox, timedelta(hours=1)))
    with paused_before_commit(sessions) as (paused, resume):
        staff = Background(lambda: approvals.approve(ANN, request_id))
        assert paused.wait(timeout=30), "the approval never reached its commit"

        def app_side() -> Operation:
            with rig.sessions.begin() as app:
                return app_compensates(rig, app.get(Operation, original.id) or original, app)

        app = Background(app_side)
        assert app.waits_for_a_lock(rig.engine), "the app's compensate did not wait"
        resume.set()
        decision = staff.join()
    app.join()
    assert staff.error is None and decision.won
    (approved,) = compensations(rig, original.id)
    assert approved.op_id == decision.proposal["op_id"]
    assert isinstance(app.error, InvalidInput) and app.error.code == "already_compensated"
    assert app.error.data["compensation"] == approved.op_id
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1
