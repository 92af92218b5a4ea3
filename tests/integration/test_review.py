"""The manual review queue: the service and the ``settled review`` CLI, end to end."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import event, select, update

from outbox import runs
from outbox.clock import Step
from outbox.errors import Forbidden, InvalidInput, ReviewConflict
from outbox.kinds import default_registry
from outbox.models import ClockStep, Operation, OperationEvent
from outbox.states import State
from outbox.storage.clock_steps import record_clock_step
from outbox.storage.operations import db_time
from settled.cli import main
from settled.simulator.alipay import GATEWAY as ALIPAY_GATEWAY
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from support.review import ReviewQueue
from support.staff import Staff
from tests.support.rig import GOOD as GOOD_REFUND
from tests.support.rig import HOLD, Rig

ALICE = Staff.parse("alice", "support")
BOB = Staff.parse("bob", "supervisor")
VIEWER = Staff.parse("vera", "viewer")


def in_review(rig: Rig, fault: str = "commit_then_timeout") -> tuple[int, int]:
    """An operation stuck in unknown with an open review item (lookup down for too long)."""
    rig.control.add_rule(fault, times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    assert rig.reconciler().run_once().outcomes == {"to_review": 1}
    (item,) = rig.reviews(op)
    return op, item.id


def queue(rig: Rig, registry: Any = None) -> ReviewQueue:
    return ReviewQueue(rig.sessions, rig.gateway(), registry or rig.outbox.registry)


def test_rejected_on_a_not_found_waits_out_a_step_of_the_database_clock(rig: Rig) -> None:
    """A step another process recorded: staff's "not found" proves nothing until it is over."""
    op, item = in_review(rig, fault="reset_before")  # never executed downstream
    rig.age_attempts(op, 60)  # quiet: a "not found" would prove it
    with rig.sessions.begin() as s:
        now = db_time(s)
        record_clock_step(s, Step(30.0, now, now + timedelta(seconds=60)), by="w9")
    q = queue(rig)
    why = "downstream has no record after 1 h; customer informed"
    with pytest.raises(ReviewConflict) as conflict:
        q.resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    assert (conflict.value.code, conflict.value.data["why"]) == ("not_found_unproven", "clock_step")
    assert rig.op(op).state == "unknown"
    with rig.sessions.begin() as s:  # the window is over (moved back: no sleeping)
        s.execute(update(ClockStep).values(distrust_until=db_time(s) - timedelta(seconds=10)))
    q.resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    assert (rig.op(op).state, rig.effects(op)) == ("rejected", 0)


def test_list_and_show_give_the_evidence(rig: Rig) -> None:
    op, item = in_review(rig)
    q = queue(rig)
    (row,) = q.list(VIEWER)
    assert (row["id"], row["reason"], row["op_id"], row["state"]) == (
        item,
        "lookup_unavailable",
        "op-1",
        "unknown",
    )
    assert q.list(VIEWER, tenant="globex") == []
    assert q.list(VIEWER, reason="past_key_retention") == []
    assert q.list(VIEWER, older_than=timedelta(hours=1)) == []
    shown = q.show(VIEWER, item)
    assert [a["proof"] for a in shown["attempts"]] == ["unknown"]
    (review,) = rig.reviews(op)  # staff read the attempts as the reconciler recorded them
    assert shown["attempts"] == review.evidence["attempts"]
    assert shown["operation"]["lookups"] == 1
    assert [e["to"] for e in shown["events"]] == ["planned", "submitted", "unknown", "unknown"]


def test_resolve_as_succeeded_is_verified_by_lookup_and_recorded(rig: Rig) -> None:
    op, item = in_review(rig)
    ref = rig.downstream_reference(op)
    result = queue(rig).resolve(ALICE, item, outcome="succeeded", version=1, reference=ref)
    assert result["state"] == "succeeded"
    row = rig.op(op)
    assert row.state == "succeeded"
    assert row.downstream_ref == ref
    assert row.params["amount_minor"] == 10000  # staff cannot change anything else
    (review,) = rig.reviews(op)
    assert review.resolved_by == "staff:alice"
    with rig.sessions() as s:
        last = s.scalars(
            select(OperationEvent)
            .where(OperationEvent.operation_id == op)
            .order_by(OperationEvent.id.desc())
        ).first()
    assert last is not None
    assert (last.actor, last.to_state) == ("staff:alice", "succeeded")
    assert last.evidence is not None and last.evidence["role"] == "support"
    assert rig.effects(op) == 1


def test_a_resolution_that_contradicts_the_lookup_is_refused(rig: Rig) -> None:
    op, item = in_review(rig)
    with pytest.raises(ReviewConflict) as info:
        queue(rig).resolve(
            ALICE,
            item,
            outcome="rejected",
            version=1,
            justification="customer says the refund never arrived",
        )
    assert info.value.code == "contradicts_downstream"
    with pytest.raises(ReviewConflict) as info:
        queue(rig).resolve(ALICE, item, outcome="succeeded", version=1, reference="re_made_up")
    assert info.value.code == "contradicts_downstream"
    assert rig.op(op).state == "unknown"
    assert rig.reviews(op)[0].resolved_at is None


def test_rejected_needs_a_justification_and_not_found_evidence(rig: Rig) -> None:
    op, item = in_review(rig, fault="reset_before")  # never executed downstream
    q = queue(rig)
    with pytest.raises(InvalidInput) as info:
        q.resolve(ALICE, item, outcome="rejected", version=1, justification="no")
    assert info.value.code == "justification_required"
    why = "downstream has no record after 1 h; customer informed"
    # Just after the send a "not found" proves nothing: the send may still be landing.
    with pytest.raises(ReviewConflict) as conflict:
        q.resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    assert (conflict.value.code, conflict.value.data["why"]) == ("not_found_unproven", "not_quiet")
    assert rig.op(op).state == "unknown"
    rig.make_quiet(op)  # quiet now: no request of any attempt can still land
    q.resolve(ALICE, item, outcome="rejected", version=1, justification=why)
    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "not_executed")
    assert rig.effects(op) == 0


def test_viewer_may_not_resolve_or_requery(rig: Rig) -> None:
    op, item = in_review(rig)
    q = queue(rig)
    with pytest.raises(Forbidden):
        q.resolve(VIEWER, item, outcome="succeeded", version=1, reference="x")
    with pytest.raises(Forbidden):
        q.requery(VIEWER, item)
    assert rig.op(op).state == "unknown"


@pytest.mark.parametrize(("staff", "role"), [("", "support"), ("alice", "root"), (None, None)])
def test_staff_identity_and_role_are_required(staff: Any, role: Any) -> None:
    with pytest.raises(InvalidInput):
        Staff.parse(staff, role)


def test_two_staff_resolving_at_once_one_wins_the_other_gets_a_conflict(rig: Rig) -> None:
    op, item = in_review(rig)
    ref = rig.downstream_reference(op)
    barrier = threading.Barrier(2)
    results: list[str] = []

    def resolve(staff: Staff) -> None:
        q = queue(rig)
        barrier.wait()
        try:
            q.resolve(staff, item, outcome="succeeded", version=1, reference=ref)
            results.append("won")
        except ReviewConflict as exc:
            results.append(exc.code)

    threads = [threading.Thread(target=resolve, args=(s,)) for s in (ALICE, BOB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # The loser is told somebody else resolved it: at its write, or already at its read.
    assert sorted(results) in (["lost_race", "won"], ["already_resolved", "won"])
    with rig.sessions() as s:
        resolutions = s.scalars(
            select(OperationEvent.actor).where(
                OperationEvent.operation_id == op,
                OperationEvent.from_state == "unknown",
                OperationEvent.to_state == "succeeded",
            )
        ).all()
    assert len(resolutions) == 1


def test_requery_settles_when_the_lookup_is_back(rig: Rig) -> None:
    op, item = in_review(rig)
    result = queue(rig).requery(ALICE, item)
    assert (result["lookup"], result["state"]) == ("found", "succeeded")
    assert rig.op(op).state == "succeeded"
    assert rig.reviews(op)[0].resolved_by == "staff:alice"


def test_requery_that_finds_nothing_is_recorded(rig: Rig) -> None:
    _op, item = in_review(rig)
    rig.control.add_rule("lookup_unavailable", times=1)
    result = queue(rig).requery(BOB, item)
    assert (result["lookup"], result["state"]) == ("unavailable", "unknown")
    with rig.sessions() as s:
        actors = s.scalars(
            select(OperationEvent.actor).where(OperationEvent.reason == "staff_requery")
        ).all()
    assert actors == ["staff:bob"]


# -- the CLI, end to end -------------------------------------------------------------------


#: The rig's keys: ``settled review`` and ``reconcile`` refuse the development ones against
#: PostgreSQL.
OWN_KEYS = {
    "SETTLED_FINGERPRINT_KEYS": json.dumps({"v1": "test-fingerprint-key-0001"}),
    "SETTLED_IDEMPOTENCY_SECRET": "test-idempotency-secret",
}


def cli(rig: Rig, *args: str, staff: str = "alice", role: str = "support") -> Any:
    """``settled review ARGS`` on the rig, configured as an operator configures it."""
    env = cli_env(rig, staff=staff, role=role)
    return CliRunner().invoke(main, ["review", *args], env=env, catch_exceptions=False)


def cli_env(rig: Rig, *, staff: str = "alice", role: str = "support") -> dict[str, str]:
    """The environment of a ``settled`` command on the rig: its database, and its downstream
    in the rig's mode (the wire protocol, Stripe, WeChat Pay or Alipay), as an operator sets
    them."""
    env = {
        "SETTLED_DATABASE_URL": rig.engine.url.render_as_string(hide_password=False),
        "SETTLED_DOWNSTREAM_URL": rig.url,
        "SETTLED_DOWNSTREAM_API_KEYS": json.dumps({"acme": rig.tenant.api_key.get_secret_value()}),
        "SETTLED_DOWNSTREAM_TIMEOUT": "2",
        **OWN_KEYS,
        "SETTLED_STAFF_ID": staff,
        "SETTLED_STAFF_ROLE": role,
    }
    if rig.stripe:  # refunds through the Stripe gateway, configured as an operator does
        env["SETTLED_DOWNSTREAM_PROVIDERS"] = json.dumps({"refund": "stripe"})
        env["SETTLED_STRIPE_API_KEYS"] = env["SETTLED_DOWNSTREAM_API_KEYS"]
        env["SETTLED_STRIPE_API_BASE"] = rig.url + STRIPE_PREFIX
    if rig.wechatpay is not None:  # refunds through the WeChat Pay gateway, as configured
        env["SETTLED_DOWNSTREAM_PROVIDERS"] = json.dumps({"refund": "wechatpay"})
        merchant = rig.wechatpay.model_dump(mode="json", exclude_none=True)
        merchant["private_key"] = rig.wechatpay.private_key_pem().decode()
        if rig.wechatpay.api_v3_key is not None:  # a secret too: its value, not its mask
            merchant["api_v3_key"] = rig.wechatpay.api_v3_key.get_secret_value()
        env["SETTLED_WECHATPAY_MERCHANTS"] = json.dumps({"acme": merchant})
        env["SETTLED_WECHATPAY_API_BASE"] = rig.url + "/wechatpay"
        env["SETTLED_WECHATPAY_ORDER_TOTALS"] = "tests.support.wechatpay:order_total"
    if rig.alipay is not None:  # refunds through the Alipay gateway, as an operator sets it
        app = rig.alipay
        env["SETTLED_DOWNSTREAM_PROVIDERS"] = json.dumps({"refund": "alipay"})
        env["SETTLED_ALIPAY_APP_IDS"] = json.dumps({"acme": app.app_id})
        env["SETTLED_ALIPAY_PRIVATE_KEYS"] = json.dumps(
            {"acme": app.private_key.get_secret_value()}
        )
        env["SETTLED_ALIPAY_PUBLIC_KEYS"] = json.dumps({"acme": app.alipay_public_key})
        env["SETTLED_ALIPAY_GATEWAY_URL"] = rig.url + ALIPAY_GATEWAY
    return env


def test_review_cli_end_to_end(rig: Rig) -> None:
    op, item = in_review(rig)
    listed = cli(rig, "list", "--json", role="viewer")
    assert listed.exit_code == 0, listed.output
    assert [i["id"] for i in json.loads(listed.output)] == [item]
    text = cli(rig, "list", role="viewer")
    assert "lookup_unavailable" in text.output and "1 item(s)" in text.output
    header, row, _ = text.output.splitlines()  # the columns have headers, values under them
    assert header.split() == ["ITEM", "TENANT", "OP_ID", "KIND", "REASON", "VERSION", "SINCE"]
    for column, value in (("ITEM", f"#{item}"), ("TENANT", "acme"), ("REASON", "lookup_")):
        assert row.index(value) == header.index(column), (header, row)
    shown = json.loads(cli(rig, "show", str(item)).output)
    version = shown["item"]["version"]
    refused = cli(rig, "resolve", str(item), "--as", "rejected", "--version", str(version),
                  "--justification", "customer called: nothing arrived")  # fmt: skip
    assert refused.exit_code == 1
    assert "contradicts_downstream" in refused.output
    ref = rig.downstream_reference(op)
    ok = cli(rig, "resolve", str(item), "--as", "succeeded", "--version", str(version),
             "--reference", ref)  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["state"] == "succeeded"
    again = cli(rig, "resolve", str(item), "--as", "succeeded", "--version", str(version),
                "--reference", ref, staff="bob")  # fmt: skip
    assert again.exit_code == 1
    assert "already_resolved" in again.output
    viewer = cli(rig, "requery", str(item), role="viewer")
    assert viewer.exit_code == 1 and "forbidden" in viewer.output
    with rig.sessions() as s:
        assert s.get(Operation, op).state == "succeeded"  # type: ignore[union-attr]


def test_review_cli_refuses_without_staff_identity(rig: Rig) -> None:
    result = CliRunner().invoke(main, ["review", "list"], env={"SETTLED_STAFF_ID": ""})
    assert result.exit_code != 0


def test_reconcile_once_prints_the_pass_report(rig: Rig) -> None:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    env = {
        "SETTLED_DATABASE_URL": rig.engine.url.render_as_string(hide_password=False),
        "SETTLED_DOWNSTREAM_URL": rig.url,
        "SETTLED_DOWNSTREAM_API_KEYS": json.dumps({"acme": rig.tenant.api_key.get_secret_value()}),
        **OWN_KEYS,
    }
    result = CliRunner().invoke(main, ["reconcile", "--once"], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["claimed"] == 1
    assert report["outcomes"] == {"found": 1}
    assert rig.op(op).state == "succeeded"


# -- a "not found" staff can trust; one lock order; items settle with their operation -------


WHY = "downstream has no record of it; customer informed by phone"


def test_rejected_on_not_found_past_key_retention_needs_a_supervisors_override(
    rig: Rig,
) -> None:
    op, item = in_review(rig, fault="reset_before")  # never executed downstream
    rig.age_attempts(op, 25 * 3600)
    rig.set(op, first_sent_at=datetime.now(UTC) - timedelta(hours=25))
    q = queue(rig)
    with pytest.raises(ReviewConflict) as conflict:
        q.resolve(ALICE, item, outcome="rejected", version=1, justification=WHY)
    assert (conflict.value.code, conflict.value.data["why"]) == (
        "not_found_unproven",
        "past_key_retention",
    )
    with pytest.raises(Forbidden):
        q.resolve(ALICE, item, outcome="rejected", version=1, justification=WHY, override=True)
    with pytest.raises(InvalidInput):
        q.resolve(BOB, item, outcome="succeeded", version=1, reference="re_x", override=True)
    assert rig.op(op).state == "unknown"
    q.resolve(BOB, item, outcome="rejected", version=1, justification=WHY, override=True)
    assert rig.op(op).state == "rejected"
    with rig.sessions() as s:
        evidence = s.scalars(
            select(OperationEvent.evidence).where(
                OperationEvent.operation_id == op, OperationEvent.to_state == "rejected"
            )
        ).one()
    assert evidence["override"] is True
    assert evidence["unproven"] == "past_key_retention"
    assert evidence["by"] == "staff:bob"
    assert rig.reviews(op)[0].resolution["override"] is True  # type: ignore[index]
    assert rig.effects(op) == 0


def test_rejected_right_after_a_send_to_a_downstream_without_idempotency_is_refused(
    rig: Rig,
) -> None:
    registry = default_registry().with_contract("refund", idempotent=False)
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    rig.control.set_switches(lookup_visibility_delay=3600)  # done, not yet visible
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    assert rig.reconciler(registry).run_once().outcomes == {"to_review": 1}
    (item,) = rig.reviews(op)
    assert item.reason == "ambiguous_without_idempotency"
    with pytest.raises(ReviewConflict) as conflict:
        queue(rig, registry).resolve(
            ALICE, item.id, outcome="rejected", version=1, justification=WHY
        )
    assert conflict.value.data["why"] == "not_quiet"
    assert rig.op(op).state == "unknown"
    assert rig.effects(op) == 1


WRITE = re.compile(r"(?<!FOR )\b(?:UPDATE|INSERT INTO)\s+(\w+)")


def writes(statements: list[str]) -> list[str]:
    """The tables written, in order, by the statements captured; within one statement in the
    order its parts are written (PostgreSQL's one statement per batch of transitions writes
    review items only for the operation rows its UPDATE of operations returned, so after
    it has locked them)."""
    return [table for sql in statements for table in WRITE.findall(sql)]


@pytest.fixture
def statements(rig: Rig) -> Any:
    seen: list[str] = []

    def capture(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        seen.append(sql.strip())

    event.listen(rig.engine, "before_cursor_execute", capture)
    yield seen
    event.remove(rig.engine, "before_cursor_execute", capture)


def first_write(tables: list[str], name: str) -> int:
    return next(i for i, t in enumerate(tables) if t == name)


def test_staff_resolve_locks_the_operation_before_its_review_item(
    rig: Rig, statements: list[str]
) -> None:
    """The reconciler writes the operation row, then the review item; staff must too, or the
    two deadlock on PostgreSQL."""
    op, item = in_review(rig)
    ref = rig.downstream_reference(op)
    statements.clear()
    queue(rig).resolve(ALICE, item, outcome="succeeded", version=1, reference=ref)
    tables = writes(statements)
    assert first_write(tables, "operations") < first_write(tables, "review_items")


def test_the_reconciler_locks_the_operation_before_its_review_item(
    rig: Rig, statements: list[str]
) -> None:
    op, _item = in_review(rig)
    rig.make_due(op)
    statements.clear()
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    tables = writes(statements)
    assert first_write(tables, "operations") < first_write(tables, "review_items")


def race_staff_and_reconciler(rig: Rig, op: int, item: int, ref: str) -> list[BaseException]:
    """Staff resolve and a reconcile pass settle ``op`` at the same moment; what they raised
    other than the expected conflict."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def staff() -> None:
        barrier.wait()
        try:
            queue(rig).resolve(ALICE, item, outcome="succeeded", version=1, reference=ref)
        except ReviewConflict:
            pass
        except BaseException as exc:  # a deadlock would surface here
            errors.append(exc)

    def reconcile() -> None:
        barrier.wait()
        try:
            rig.reconciler().run_once()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=staff), threading.Thread(target=reconcile)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_staff_and_reconciler_on_one_item_at_once_never_deadlock(rig: Rig) -> None:
    """Both settle the same operation concurrently, many times over: one of them settles it
    each time, and the database never reports a deadlock."""
    for n in range(8):
        rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
        rig.control.add_rule("lookup_unavailable", times=1)
        op = rig.enqueue(f"op-{n}", {**GOOD_REFUND, "amount_minor": 100 + n})
        rig.executor().execute([op])
        rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
        assert rig.reconciler().run_once().outcomes == {"to_review": 1}
        (item,) = rig.reviews(op)
        ref = rig.downstream_reference(op)
        rig.make_due(op)
        assert race_staff_and_reconciler(rig, op, item.id, ref) == []
        assert rig.op(op).state == "succeeded"
        assert rig.reviews(op)[0].resolved_at is not None


def test_an_operation_requeued_after_its_item_opened_takes_the_item_with_it(rig: Rig) -> None:
    op, item = in_review(rig, fault="reset_before")  # never executed downstream
    rig.make_quiet(op)
    rig.make_due(op)
    assert rig.reconciler().run_once().outcomes == {"requeued": 1}
    (review,) = rig.reviews(op)
    assert review.resolved_at is not None
    assert review.resolution == {
        "state": "planned",
        "by": "reconciler:r1",
        "settled_with_operation": True,
    }
    with pytest.raises(ReviewConflict) as conflict:
        queue(rig).resolve(ALICE, item, outcome="rejected", version=1, justification=WHY)
    assert conflict.value.code == "already_resolved"
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1


def test_a_staff_statement_without_lookup_is_reported_as_theirs(rig: Rig) -> None:
    registry = default_registry().with_contract("refund", queryable=False)
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor(registry).execute([op])
    assert rig.reconciler(registry).run_once().outcomes == {"to_review": 1}
    (item,) = rig.reviews(op)
    queue(rig, registry).resolve(
        ALICE, item.id, outcome="succeeded", version=1, reference="bank-stmt-77"
    )
    row = rig.op(op)
    assert row.receipt == {
        "source": "staff",
        "staff": "alice",
        "status": "succeeded",
        "reference": "bank-stmt-77",
    }
    with rig.sessions() as s:
        status = runs.operation_status(s, "acme", "op-1")
    assert status["message"] == "done_staff"


def test_review_cli_override_is_a_supervisors_and_is_recorded(rig: Rig) -> None:
    op, item = in_review(rig, fault="reset_before")
    rig.age_attempts(op, 25 * 3600)
    rig.set(op, first_sent_at=datetime.now(UTC) - timedelta(hours=25))
    args = ["resolve", str(item), "--as", "rejected", "--version", "1", "--justification", WHY]
    unproven = cli(rig, *args)
    assert unproven.exit_code == 1 and "not_found_unproven" in unproven.output
    support = cli(rig, *args, "--override")
    assert support.exit_code == 1 and "forbidden" in support.output
    ok = cli(rig, *args, "--override", staff="bob", role="supervisor")
    assert ok.exit_code == 0, ok.output
    assert rig.op(op).state == "rejected"
    assert rig.reviews(op)[0].resolution["override"] is True  # type: ignore[index]
