"""Every review reason has a way out: each is produced end to end, then resolved as
docs/support.md documents, and the operation leaves ``unknown`` with its item closed. A refused
staff action leaves a trace in the database."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from outbox import runs
from outbox.downstream import LookupMisuse, Misuse, Receipt, SubmitOutcome
from outbox.errors import Forbidden, ReviewConflict
from outbox.fingerprint import Fingerprinter
from outbox.kinds import KindRegistry, default_registry
from outbox.models import OperationEvent
from support.review import ReviewQueue
from support.staff import REASONS, Staff
from tests.integration.test_send_fencing import Poisoned
from tests.support.gateways import Interposed
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.simtools import fenced

ALICE = Staff.parse("alice", "support")
BOB = Staff.parse("bob", "supervisor")
VERA = Staff.parse("vera", "viewer")
WHY = "checked with the payment service's support desk, ticket 4471"


@dataclass
class Case:
    """How to put an operation in review for one reason, and how staff then resolve it."""

    registry: KindRegistry
    setup: Callable[[Rig, KindRegistry], int]
    resolve: Callable[[Rig, ReviewQueue, int, int], None]
    state: str  # what the operation ends as
    postgres_only: bool = False
    #: the state it is in while in review: unknown, or already rejected where nothing was sent
    before: str = "unknown"


def registry(**contract: Any) -> KindRegistry:
    return (
        default_registry().with_contract("refund", **contract) if contract else default_registry()
    )


def sent(
    rig: Rig, reg: KindRegistry, rewrite: Callable[[SubmitOutcome], SubmitOutcome] | None = None
) -> int:
    op = rig.enqueue()
    executor = rig.executor(reg)
    executor.gateway = Interposed(executor.gateway, rewrite_submit=rewrite)
    executor.execute([op])
    return op


def reconcile(rig: Rig, reg: KindRegistry, op: int, reconciler: Any = None) -> None:
    rig.make_due(op)
    (reconciler or rig.reconciler(reg)).run_once()


# -- set-ups ------------------------------------------------------------------------------


def lookup_unavailable(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = sent(rig, reg)
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    reconcile(rig, reg, op)
    return op


def ambiguous_without_idempotency(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    rig.control.set_switches(lookup_visibility_delay=3600)
    op = sent(rig, reg)
    reconcile(rig, reg, op)
    rig.control.set_switches(lookup_visibility_delay=0)
    return op


def receipt_mismatch(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("mismatched_receipt", times=1)
    return sent(rig, reg)


def lookup_mismatch(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = sent(rig, reg)
    real = rig.downstream_reference(op)
    odd = Receipt(real, "succeeded", {**rig.op(op).params, "amount_minor": 1})
    reconciler = rig.reconciler(reg)
    key = rig.op(op).idempotency_key
    reconciler.gateway = Interposed(
        reconciler.gateway,
        lookup_as={key: LookupMisuse("receipt_mismatch", "differs", odd)},
    )
    reconcile(rig, reg, op, reconciler)
    return op


def misuse_after_a_real_send(code: str) -> Callable[[Rig, KindRegistry], int]:
    def setup(rig: Rig, reg: KindRegistry) -> int:
        return sent(rig, reg, lambda _outcome: Misuse(code, "scripted", 200))

    return setup


def misuse_never_executed(code: str) -> Callable[[Rig, KindRegistry], int]:
    def setup(rig: Rig, reg: KindRegistry) -> int:
        rig.control.add_rule("reset_before", times=1)  # nothing executed downstream
        op = sent(rig, reg, lambda _outcome: Misuse(code, "scripted", 502))
        rig.age_attempts(op, 60)  # and quiet since
        return op

    return setup


def outcome_not_recorded(rig: Rig, reg: KindRegistry) -> int:
    op = rig.enqueue()
    executor = rig.executor(reg)
    executor.gateway = Poisoned(executor.gateway, rig.op(op).idempotency_key)
    executor.execute([op])
    return op


def reconcile_failed(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = sent(rig, reg)
    reconciler = rig.reconciler(reg)
    reconciler.gateway = Poisoned(reconciler.gateway, rig.op(op).idempotency_key)
    reconcile(rig, reg, op, reconciler)
    return op


def past_key_retention(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("reset_before", times=1)
    op = sent(rig, reg)
    rig.age_attempts(op, 25 * 3600)
    rig.set(op, first_sent_at=datetime.now(UTC) - timedelta(hours=25))
    reconcile(rig, reg, op)
    return op


def ambiguous_at_send(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    return sent(rig, reg)  # to review at once: nothing can settle it automatically


def no_lookup(rig: Rig, reg: KindRegistry) -> int:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = sent(rig, reg)
    reconcile(rig, reg, op)
    return op


class WorkerDied(Exception):
    pass


def no_lookup_worker_died(rig: Rig, reg: KindRegistry) -> int:
    op = rig.enqueue()
    executor = rig.executor(reg)

    def die(_key: str) -> None:
        raise WorkerDied

    executor.gateway = Interposed(executor.gateway, before_submit=die)
    with pytest.raises(WorkerDied):
        executor.execute([op])
    rig.set(op, lease_until=datetime.now(UTC) - timedelta(seconds=1))
    reconcile(rig, reg, op)  # abandoned: unknown
    reconcile(rig, reg, op)  # no lookup: review
    return op


def fingerprint_mismatch(rig: Rig, reg: KindRegistry) -> int:
    """The app fingerprints with another key than the worker's: never sent, rejected."""
    app = replace(
        rig.outbox, fingerprinter=Fingerprinter({"v1": b"another-fingerprint-key-0002"}, "v1")
    )
    with rig.sessions.begin() as s:
        op = app.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=GOOD).operation.id
    rig.executor(reg).execute([op])
    return op


# -- resolutions ----------------------------------------------------------------------------


def as_its_record(rig: Rig, q: ReviewQueue, op: int, item: int) -> None:
    q.resolve(ALICE, item, outcome="succeeded", version=1, reference=rig.downstream_reference(op))


def rejected_on_proof(rig: Rig, q: ReviewQueue, op: int, item: int) -> None:
    q.resolve(ALICE, item, outcome="rejected", version=1, justification=WHY)


def supervisor_override(rig: Rig, q: ReviewQueue, op: int, item: int) -> None:
    q.resolve(BOB, item, outcome="rejected", version=1, justification=WHY, override=True)


def staff_statement(rig: Rig, q: ReviewQueue, op: int, item: int) -> None:
    q.resolve(ALICE, item, outcome="succeeded", version=1, reference="bank-stmt-2291")


NOT_IDEMPOTENT = registry(idempotent=False)
NO_LOOKUP = registry(queryable=False)
NEITHER = registry(idempotent=False, queryable=False)
CASES: dict[str, Case] = {
    "lookup_unavailable": Case(default_registry(), lookup_unavailable, as_its_record, "succeeded"),
    "ambiguous_without_idempotency": Case(
        NOT_IDEMPOTENT, ambiguous_without_idempotency, as_its_record, "succeeded"
    ),
    "receipt_mismatch": Case(default_registry(), receipt_mismatch, as_its_record, "succeeded"),
    "lookup_mismatch": Case(default_registry(), lookup_mismatch, as_its_record, "succeeded"),
    "receipt_key_mismatch": Case(
        default_registry(),
        misuse_after_a_real_send("receipt_key_mismatch"),
        as_its_record,
        "succeeded",
    ),
    "receipt_unreadable": Case(
        default_registry(),
        misuse_after_a_real_send("receipt_unreadable"),
        as_its_record,
        "succeeded",
    ),
    "idempotency_error": Case(
        fenced(),  # the simulator, the downstream here, refuses requests past their deadline
        misuse_never_executed("idempotency_error"),
        rejected_on_proof,
        "rejected",
    ),
    "unexpected_response": Case(
        fenced(),  # the simulator, the downstream here, refuses requests past their deadline
        misuse_never_executed("unexpected_response"),
        rejected_on_proof,
        "rejected",
    ),
    "outcome_not_recorded": Case(
        default_registry(), outcome_not_recorded, as_its_record, "succeeded", postgres_only=True
    ),
    "reconcile_failed": Case(
        default_registry(), reconcile_failed, as_its_record, "succeeded", postgres_only=True
    ),
    "past_key_retention": Case(
        default_registry(), past_key_retention, supervisor_override, "rejected"
    ),
    "no_lookup_replay_cannot_settle": Case(NO_LOOKUP, no_lookup, staff_statement, "succeeded"),
    "no_lookup_without_idempotency": Case(
        NEITHER, no_lookup_worker_died, staff_statement, "succeeded"
    ),
    "ambiguous_without_idempotency_or_lookup": Case(
        NEITHER, ambiguous_at_send, staff_statement, "succeeded"
    ),
    "fingerprint_mismatch": Case(
        default_registry(), fingerprint_mismatch, rejected_on_proof, "rejected", before="rejected"
    ),
}


#: Reasons of items with no operation, whose way out is shown where they are produced:
#: ``orphan_effect`` in tests/integration/test_ops_audit.py (resolved as succeeded, by a person).
WITHOUT_OPERATION = {"orphan_effect"}


def test_every_documented_reason_has_a_case() -> None:
    assert set(CASES) | WITHOUT_OPERATION == set(REASONS)


def way_out(rig: Rig, reason: str) -> None:
    case = CASES[reason]
    op = case.setup(rig, case.registry)
    assert rig.op(op).state == case.before
    (item,) = rig.reviews(op)
    assert (item.reason, item.resolved_at) == (reason, None)
    q = ReviewQueue(rig.sessions, rig.gateway(), case.registry)
    case.resolve(rig, q, op, item.id)
    assert rig.op(op).state == case.state
    (closed,) = rig.reviews(op)
    assert closed.resolved_at is not None


@pytest.mark.parametrize("reason", sorted(r for r, c in CASES.items() if not c.postgres_only))
def test_every_review_reason_has_a_way_out(rig: Rig, reason: str) -> None:
    way_out(rig, reason)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("reason", sorted(r for r, c in CASES.items() if c.postgres_only))
def test_every_review_reason_only_postgresql_produces_has_a_way_out(rig: Rig, reason: str) -> None:
    """Only PostgreSQL refuses an overlong reference (SQLite stores it)."""
    way_out(rig, reason)


def test_a_receipt_mismatch_is_stored_as_what_the_downstream_did(rig: Rig) -> None:
    op = receipt_mismatch(rig, default_registry())
    (item,) = rig.reviews(op)
    q = ReviewQueue(rig.sessions, rig.gateway(), default_registry())
    as_its_record(rig, q, op, item.id)
    row = rig.op(op)
    assert row.receipt["differs_from_intent"] is True  # type: ignore[index]
    assert row.receipt["params"]["amount_minor"] != row.params["amount_minor"]  # type: ignore[index]
    with rig.sessions() as s:
        assert runs.operation_status(s, "acme", "op-1")["message"] == "done_differs"


def refusals(rig: Rig, op: int) -> list[tuple[str, dict[str, Any]]]:
    with rig.sessions() as s:
        rows = s.execute(
            select(OperationEvent.actor, OperationEvent.evidence)
            .where(OperationEvent.operation_id == op, OperationEvent.reason == "staff_refused")
            .order_by(OperationEvent.id)
        ).all()
    return [(actor, evidence) for actor, evidence in rows]


def test_refused_staff_actions_are_recorded_with_the_staff_id(rig: Rig) -> None:
    op = lookup_unavailable(rig, default_registry())
    (item,) = rig.reviews(op)
    q = ReviewQueue(rig.sessions, rig.gateway(), default_registry())
    with pytest.raises(Forbidden):
        q.resolve(VERA, item.id, outcome="succeeded", version=1, reference="re_x")
    with pytest.raises(ReviewConflict):  # contradicts the downstream's record
        q.resolve(ALICE, item.id, outcome="rejected", version=1, justification=WHY)
    as_its_record(rig, q, op, item.id)
    with pytest.raises(ReviewConflict):  # somebody resolved it already
        q.resolve(
            BOB, item.id, outcome="succeeded", version=1, reference=rig.downstream_reference(op)
        )
    with pytest.raises(Forbidden):
        q.requery(VERA, item.id)
    got = [(actor, e["action"], e["code"]) for actor, e in refusals(rig, op)]
    assert got == [
        ("staff:vera", "resolve", "forbidden"),
        ("staff:alice", "resolve", "contradicts_downstream"),
        ("staff:bob", "resolve", "already_resolved"),
        ("staff:vera", "requery", "forbidden"),
    ]
    assert rig.op(op).state == "succeeded"


def test_a_fingerprint_mismatch_is_confirmed_never_changed(rig: Rig) -> None:
    """Its operation is rejected already (nothing was sent): staff confirm it, with a
    justification; "succeeded" is refused and recorded, and the operation never changes."""
    op = fingerprint_mismatch(rig, default_registry())
    (item,) = rig.reviews(op)
    q = ReviewQueue(rig.sessions, rig.gateway(), default_registry())
    (listed,) = q.list(ALICE, reason="fingerprint_mismatch")
    assert (listed["op_id"], listed["state"]) == ("op-1", "rejected")
    assert q.show(ALICE, item.id)["item"]["reason"] == "fingerprint_mismatch"
    with pytest.raises(ReviewConflict) as refused:
        q.resolve(ALICE, item.id, outcome="succeeded", version=1, reference="re_made_up_1")
    assert refused.value.code == "terminal"
    assert rig.reviews(op)[0].resolved_at is None
    assert q.resolve(ALICE, item.id, outcome="rejected", version=1, justification=WHY) == {
        "item": item.id,
        "state": "rejected",
        "operation": "op-1",
    }
    (closed,) = rig.reviews(op)
    assert (closed.resolved_by, closed.note) == ("staff:alice", WHY)
    assert (rig.op(op).state, rig.op(op).reason) == ("rejected", "not_executed")
    with rig.sessions() as s:
        notes = s.scalars(
            select(OperationEvent.reason)
            .where(OperationEvent.operation_id == op)
            .order_by(OperationEvent.id)
        ).all()
    assert notes[-2:] == ["staff_refused", "staff_confirmed"]
    with pytest.raises(ReviewConflict):  # somebody resolved it already
        q.resolve(BOB, item.id, outcome="rejected", version=1, justification=WHY)


@pytest.mark.parametrize("setup", [receipt_mismatch, lookup_mismatch])
def test_a_mismatch_whose_lookup_found_an_executed_refund_offers_only_succeeded(
    rig: Rig, setup: Callable[[Rig, KindRegistry], int]
) -> None:
    """The downstream's record says the refund was made: "rejected" would be refused by the
    resolve, so it is not offered; the record's reference is shown for staff to confirm."""
    op = setup(rig, default_registry())
    if setup is receipt_mismatch:  # the send's receipt differed: a look finds the record
        reconcile(rig, default_registry(), op)
    (item,) = rig.reviews(op)
    q = ReviewQueue(rig.sessions, rig.gateway(), default_registry())
    shown = q.show(ALICE, item.id)
    assert shown["last_lookup"] == "mismatch"
    record = shown["lookups"][-1]["record"]
    assert record == {"reference": rig.downstream_reference(op), "status": "succeeded"}
    assert shown["choices"] == [{"outcome": "succeeded", "override": False}]
    # what the page offers is what the resolve accepts
    with pytest.raises(ReviewConflict):
        q.resolve(ALICE, item.id, outcome="rejected", version=1, justification=WHY)
    as_its_record(rig, q, op, item.id)
    assert rig.op(op).state == "succeeded"
