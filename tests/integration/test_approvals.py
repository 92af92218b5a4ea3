"""``support.approvals``, the staff's side of agent proposals, on PostgreSQL and SQLite: the
tenant limit applied in the SQL, everything else on the order, the roles, and a decision
somebody made first. The pages over it: ``test_console_proposals.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from outbox.errors import Forbidden, NotFound
from outbox.kinds import default_registry
from outbox.models import Operation
from outbox.proposals import Proposals
from outbox.storage import search
from support.approvals import Approvals
from support.staff import Staff
from tests.support.contend import contender, pausing
from tests.support.rig import GOOD, Rig

ANN = Staff.parse("ann", "support")
BOB = Staff.parse("bob", "supervisor")
VERA = Staff.parse("vera", "viewer")
GIL = Staff("gil", BOB.role, frozenset({"globex"}))


def approvals_and_two_tenants(rig: Rig) -> tuple[Approvals, int, int]:
    """An acme refund already on order A1042, and a proposal of acme and of globex on it."""
    service = Proposals(rig.outbox, timedelta(hours=1))
    rig.enqueue("op-acme")
    ids = []
    with rig.sessions.begin() as s:
        for tenant in ("acme", "globex"):
            got = service.propose(
                s, tenant=tenant, kind="refund", params={**GOOD, "amount_minor": 5000},
                reason="second parcel lost",
            )  # fmt: skip
            ids.append(got.proposal.id)
    return Approvals(rig.sessions, service), ids[0], ids[1]


def op_ids(rig: Rig) -> list[str]:
    with rig.sessions() as s:
        return list(s.scalars(select(Operation.op_id).order_by(Operation.id)))


def test_a_limited_member_sees_only_their_tenants_proposals_and_orders(rig: Rig) -> None:
    approvals, acme, globex = approvals_and_two_tenants(rig)
    everything = approvals.waiting(BOB)
    assert [p["id"] for p in everything["items"]] == [acme, globex] and everything["total"] == 2
    assert [op["op_id"] for op in everything["items"][0]["operations"]] == ["op-acme"]
    assert everything["items"][1]["operations"] == []  # acme's refund is not globex's order
    limited = approvals.waiting(GIL)
    assert [p["id"] for p in limited["items"]] == [globex] and limited["total"] == 1
    with pytest.raises(NotFound):
        approvals.show(GIL, acme)
    with pytest.raises(NotFound):
        approvals.approve(GIL, acme)
    shown = approvals.show(ANN, acme)
    assert (shown["amount_minor"], shown["payee"], shown["reason"]) == (
        5000,
        "P-7",
        "second parcel lost",
    )
    assert [op["op_id"] for op in shown["operations"]] == ["op-acme"]
    assert shown["other_proposals"] == []
    assert op_ids(rig) == ["op-acme"]


def test_a_viewer_may_not_decide(rig: Rig) -> None:
    approvals, acme, _ = approvals_and_two_tenants(rig)
    for decide in (approvals.approve, approvals.decline):
        with pytest.raises(Forbidden):
            decide(VERA, acme)
    assert approvals.show(ANN, acme)["status"] == "proposed" and op_ids(rig) == ["op-acme"]


def test_the_first_decision_wins_and_the_second_is_told_who_made_it(rig: Rig) -> None:
    approvals, acme, globex = approvals_and_two_tenants(rig)
    first = approvals.approve(ANN, acme)
    assert first.won and first.proposal["decided_by"] == "staff:ann"
    assert op_ids(rig) == ["op-acme", first.proposal["op_id"]]
    for late in (approvals.approve(BOB, acme), approvals.decline(BOB, acme)):
        assert not late.won
        assert (late.proposal["status"], late.proposal["decided_by"]) == ("approved", "staff:ann")
    assert len(op_ids(rig)) == 2
    # globex's proposal on the same order id shows nothing of acme's
    assert approvals.show(BOB, globex)["other_proposals"] == []
    declined = approvals.decline(GIL, globex)
    assert declined.won and declined.proposal["op_id"] is None and len(op_ids(rig)) == 2


def test_two_decisions_at_once_one_wins_and_the_other_is_told_who_decided(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ann approves while Bob declines: both read the proposal waiting, then write. On SQLite
    the second writer got "database is locked" (a deferred transaction whose snapshot went
    stale), not "somebody else decided first"."""
    approvals, acme, _ = approvals_and_two_tenants(rig)
    with contender(lambda: approvals.decline(BOB, acme)) as bob:
        pausing(monkeypatch, Proposals, "approve", bob)
        ann = approvals.approve(ANN, acme)
        declined = bob.result()
    winner, loser = (ann, declined) if ann.won else (declined, ann)
    assert winner.won and not loser.won
    decided = (winner.proposal["status"], winner.proposal["decided_by"])
    assert decided in {("approved", "staff:ann"), ("declined", "staff:bob")}
    assert (loser.proposal["status"], loser.proposal["decided_by"]) == decided
    assert len(op_ids(rig)) == (2 if decided[0] == "approved" else 1)


def test_what_else_is_on_an_order_is_found_by_exact_pairs_newest_kept(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Orders of several tenants at once: rows of another pairing (acme's B2001, asked for
    globex only) never take the place of the ones asked for, and the cap keeps the newest."""
    monkeypatch.setattr(search, "MAX_ON_ORDERS", 2)
    for n in range(3):  # older, on acme's B2001: not asked for
        rig.enqueue(f"op-b{n}", {**GOOD, "order_id": "B2001"})
    first = rig.enqueue("op-a0")
    latest = rig.enqueue("op-a1", {**GOOD, "amount_minor": 500})
    newest = rig.enqueue("op-a2", {**GOOD, "amount_minor": 600})
    with rig.sessions() as s:
        _, operations = search.on_orders(
            s, [("acme", "A1042"), ("globex", "B2001")], kinds=default_registry()
        )
    assert [op.id for op in operations] == [latest, newest]  # oldest first, the newest two
    assert first not in [op.id for op in operations]
