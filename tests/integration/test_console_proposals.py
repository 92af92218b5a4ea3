"""The console's Proposals page over HTTP with its real sign-in, against real PostgreSQL and the
simulator: staff see what AI agents proposed with everything else on the order, approve (the
exact parameters become an operation) or decline; roles, tenant limits, the CSRF token, a
tampered proposal, and two staff deciding the same proposal (one after the other, and at once).

Proposals are made by the service the MCP tools use (``Proposals.propose``); the browser test
(``tests/e2e/test_console_browser.py``) makes one through a real ``request_refund``.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session
from starlette.exceptions import StarletteDeprecationWarning

from outbox.kinds import default_registry
from outbox.models import Operation, Proposal, Run
from outbox.proposals import Proposals
from settled.web import create_web_app
from support.approvals import Approvals
from support.review import ReviewQueue
from support.staff import Staff
from tests.integration.test_console_roles import add_staff, post, sign_in
from tests.support.rig import GOOD, Rig
from tests.support.simtools import wait_until

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.postgres

SECOND = {**GOOD, "amount_minor": 5000}


@pytest.fixture
def engine(pg: Engine) -> Engine:
    """PostgreSQL only, as the console's other page tests."""
    return pg


@pytest.fixture
def service(rig: Rig) -> Proposals:
    return Proposals(rig.outbox, timedelta(hours=1))


@pytest.fixture
def app(rig: Rig, service: Proposals) -> Any:
    queue = ReviewQueue(rig.sessions, rig.gateway(), default_registry(), lookup_timeout=2.0)
    return create_web_app(rig.sessions, review=queue, proposals=service)


@pytest.fixture
def client(app: Any) -> Iterator[TestClient]:
    with TestClient(app, follow_redirects=False) as c:
        yield c


def propose(
    rig: Rig, service: Proposals, params: dict[str, Any] = GOOD, *, tenant: str = "acme"
) -> int:
    with rig.sessions.begin() as s:
        got = service.propose(
            s,
            tenant=tenant,
            kind="refund",
            params=params,
            reason="parcel lost",
            correlation_id="c1",
        )
        return got.proposal.id


def proposal(rig: Rig, proposal_id: int) -> Proposal:
    with rig.sessions() as s:
        found = s.get(Proposal, proposal_id)
        assert found is not None
        return found


def operations(rig: Rig) -> list[Operation]:
    with rig.sessions() as s:
        return list(s.scalars(select(Operation).order_by(Operation.id)))


def listed(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-proposal="(\d+)">', page)]


def two_days_ago() -> datetime:
    return datetime.now(UTC) - timedelta(days=2)


def waiting_on_a_lock(engine: Engine) -> bool:
    """Whether a session of this test's database waits on a lock (others' are not counted)."""
    with engine.connect() as conn:
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return bool(conn.execute(text(query)).scalar_one())


def nothing_decided(rig: Rig, proposal_id: int) -> bool:
    p = proposal(rig, proposal_id)
    return p.status == "proposed" and p.decided_by is None and operations(rig) == []


def test_the_list_shows_the_earlier_refund_on_the_same_order(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    earlier = rig.enqueue("op-first")
    rig.executor().execute([earlier])
    assert rig.op(earlier).state == "succeeded"
    second = propose(rig, service, SECOND)
    add_staff(rig, "ann", "support")
    sign_in(client, "ann")

    assert 'href="/console/proposals"' in client.get("/console/review").text  # the nav link
    page = client.get("/console/proposals").text
    assert listed(page) == [second]
    row = page[page.index(f'data-proposal="{second}"') :]
    for shown in ("refund", "A1042", "50.00 CNY", "P-7", "parcel lost", "op-first", "100.00 CNY"):
        assert shown in row, shown
    detail = client.get(f"/console/proposals/{second}").text
    assert "This order already has 1 operation(s)" in detail
    assert 'href="/console/operations/acme/op-first"' in detail and "succeeded" in detail
    assert f'action="/console/proposals/{second}/approve"' in detail


@pytest.mark.parametrize("role", ["support", "supervisor", "admin"])
def test_approval_enqueues_the_exact_parameters_and_is_audited(
    rig: Rig,
    service: Proposals,
    client: TestClient,
    role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pid = propose(rig, service, SECOND)
    add_staff(rig, "sam", role)
    csrf = sign_in(client, "sam")
    caplog.set_level(logging.INFO, logger="settled.audit")
    r = post(client, f"/console/proposals/{pid}/approve", csrf)
    assert r.status_code == 200
    p = proposal(rig, pid)
    assert (p.status, p.decided_by) == ("approved", "staff:sam")
    (op,) = operations(rig)
    assert (op.tenant, op.op_id, op.kind, op.params) == ("acme", p.op_id, "refund", p.params)
    assert op.op_id.startswith("op_") and op.correlation_id == "c1"
    assert f"Approved: operation {op.op_id} is queued and will be sent." in r.text
    link = f'href="/console/operations/acme/{op.op_id}"'
    assert link in r.text and 'id="actions"' not in r.text
    assert client.get(f"/console/operations/acme/{op.op_id}").status_code == 200
    decided = [r for r in caplog.records if r.getMessage() == "proposal approve"]
    assert [(r.staff, r.proposal, r.op_id) for r in decided] == [("sam", pid, op.op_id)]  # type: ignore[attr-defined]
    audit_text = " ".join(f"{r.getMessage()} {r.__dict__!r}" for r in caplog.records)
    assert "P-7" not in audit_text and "A1042" not in audit_text  # no payee, no order

    rig.executor().execute([op.id])
    assert rig.control.refunded("acme", "A1042") == 5000  # what was approved, exactly


def test_decline_sends_nothing(rig: Rig, service: Proposals, client: TestClient) -> None:
    pid = propose(rig, service)
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    r = post(client, f"/console/proposals/{pid}/decline", csrf)
    assert r.status_code == 200 and "Declined: nothing will be sent." in r.text
    p = proposal(rig, pid)
    assert (p.status, p.decided_by, p.op_id) == ("declined", "staff:ann", None)
    assert operations(rig) == [] and listed(client.get("/console/proposals").text) == []


def test_proposal_times_are_time_elements_to_the_second(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    pid = propose(rig, service)
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    post(client, f"/console/proposals/{pid}/decline", csrf)
    page = client.get(f"/console/proposals/{pid}").text
    assert not re.search(r"\d\d:\d\d:\d\d\.\d", page) and "+00:00" not in page
    times = re.findall(r'<time(?: class="exact")? datetime="([^"]+)"', page)
    assert len(times) == 2  # made, decided
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", t) for t in times)


def test_a_viewer_sees_proposals_but_no_action_and_is_refused(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    pid = propose(rig, service)
    add_staff(rig, "vera", "viewer")
    csrf = sign_in(client, "vera")
    assert listed(client.get("/console/proposals").text) == [pid]
    detail = client.get(f"/console/proposals/{pid}").text
    assert "parcel lost" in detail and 'id="actions"' not in detail and "/approve" not in detail
    for verb in ("approve", "decline"):
        refused = post(client, f"/console/proposals/{pid}/{verb}", csrf)
        assert refused.status_code == 403 and "You may not do this." in refused.text
    assert nothing_decided(rig, pid)


def test_a_limited_member_sees_and_decides_only_their_tenants(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    rig.enqueue("op-acme")  # acme's refund on order A1042: not globex's business
    acme = propose(rig, service, SECOND)
    globex = propose(rig, service, SECOND, tenant="globex")
    add_staff(rig, "gil", "supervisor", ["globex"])
    csrf = sign_in(client, "gil")
    page = client.get("/console/proposals").text
    assert listed(page) == [globex] and "op-acme" not in page
    detail = client.get(f"/console/proposals/{globex}").text
    assert "op-acme" not in detail and "Nothing else on this order" in detail
    assert client.get(f"/console/proposals/{acme}").status_code == 404
    for verb in ("approve", "decline"):
        assert post(client, f"/console/proposals/{acme}/{verb}", csrf).status_code == 404
    assert proposal(rig, acme).status == "proposed"
    assert [op.op_id for op in operations(rig)] == ["op-acme"]
    assert post(client, f"/console/proposals/{globex}/approve", csrf).status_code == 200
    assert proposal(rig, globex).decided_by == "staff:gil"


def test_a_decision_without_the_csrf_token_writes_nothing(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    pid = propose(rig, service)
    add_staff(rig, "bob", "supervisor")
    sign_in(client, "bob")
    for verb in ("approve", "decline"):
        assert post(client, f"/console/proposals/{pid}/{verb}", None).status_code == 403
        assert post(client, f"/console/proposals/{pid}/{verb}", "not-it").status_code == 403
    assert nothing_decided(rig, pid)


def test_a_proposal_whose_parameters_changed_is_refused(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    pid = propose(rig, service)
    with rig.sessions.begin() as s:  # the row was altered after it was proposed
        row = s.get(Proposal, pid)
        assert row is not None
        row.params = {**row.params, "amount_minor": 99999}
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    r = post(client, f"/console/proposals/{pid}/approve", csrf)
    assert "Refused: the proposal&#39;s parameters no longer match what was proposed" in r.text
    assert nothing_decided(rig, pid)
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0


def test_the_second_of_two_staff_is_told_who_decided_first(
    rig: Rig, service: Proposals, app: Any
) -> None:
    pid = propose(rig, service)
    add_staff(rig, "bob", "supervisor")
    add_staff(rig, "ann", "support")
    bob_client = TestClient(app, follow_redirects=False)
    with bob_client as bob, TestClient(app, follow_redirects=False) as ann:
        bob_csrf, ann_csrf = sign_in(bob, "bob"), sign_in(ann, "ann")
        for c in (bob, ann):  # both have the forms open
            assert "/approve" in c.get(f"/console/proposals/{pid}").text
        assert (
            "Approved: operation" in post(bob, f"/console/proposals/{pid}/approve", bob_csrf).text
        )
        late = post(ann, f"/console/proposals/{pid}/decline", ann_csrf)
        late_zh = ann.post(
            f"/console/proposals/{pid}/approve?lang=zh", data={"csrf_token": ann_csrf}
        )
    assert late.status_code == 200
    assert re.search(r"Already decided by bob at \S+ \(Approved\)\.", late.text), late.text
    assert re.search(r"已由 bob 于 \S+ 决定（已批准）", late_zh.text), late_zh.text
    assert 'id="actions"' not in late.text and "Approved by bob at" in late.text
    assert proposal(rig, pid).decided_by == "staff:bob" and len(operations(rig)) == 1


def test_two_decisions_at_once_one_wins_the_other_writes_nothing(
    rig: Rig, service: Proposals, engine: Engine
) -> None:
    """The approval reads the proposal as waiting, then finds the decline's row lock; when the
    decline commits, its conditional UPDATE matches nothing and its operation is rolled back."""
    pid = propose(rig, service)
    approvals = Approvals(rig.sessions, service)
    result: Future[Any] = Future()

    def approve() -> None:
        try:
            result.set_result(approvals.approve(Staff.parse("ann", "support"), pid))
        except BaseException as exc:
            result.set_exception(exc)

    with Session(engine) as s, s.begin():
        row = s.get(Proposal, pid)
        assert row is not None
        service.decline(s, "acme", row.handle, by="staff:bob")  # holds the row, not committed
        racer = threading.Thread(target=approve)
        racer.start()
        wait_until(lambda: waiting_on_a_lock(engine) or result.done(), 30, "the row lock")
        assert not result.done(), "the approval did not wait for the decline"
    racer.join(timeout=30)
    decision = result.result(timeout=0)
    assert not decision.won
    assert (decision.proposal["status"], decision.proposal["decided_by"]) == (
        "declined",
        "staff:bob",
    )
    assert operations(rig) == []
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0


def test_the_proposals_page_in_chinese(rig: Rig, service: Proposals, client: TestClient) -> None:
    pid = propose(rig, service)
    add_staff(rig, "ann", "support")
    sign_in(client, "ann")
    page = client.get("/console/proposals", params={"lang": "zh"}).text
    assert "AI 智能体提出的请求" in page and "智能体请求" in page and listed(page) == [pid]
    detail = client.get(f"/console/proposals/{pid}").text  # the cookie keeps the language
    assert "批准" in detail and "拒绝" in detail and "此订单上没有其他记录" in detail


def test_an_expired_proposal_is_not_listed_and_its_approval_is_refused(
    rig: Rig, service: Proposals, client: TestClient
) -> None:
    pid = propose(rig, service)
    with rig.sessions.begin() as s:  # made two days ago; the sweeper has not marked it yet
        s.execute(update(Proposal).where(Proposal.id == pid).values(created_at=two_days_ago()))
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    assert listed(client.get("/console/proposals").text) == []
    detail = client.get(f"/console/proposals/{pid}").text
    assert "Expired without a decision: nothing was sent." in detail
    assert 'id="actions"' not in detail
    r = post(client, f"/console/proposals/{pid}/approve", csrf)
    assert r.status_code == 200, r.text
    assert "Refused: the proposal expired without a decision; nothing was sent" in r.text
    assert "Already decided" not in r.text
    assert nothing_decided(rig, pid)
