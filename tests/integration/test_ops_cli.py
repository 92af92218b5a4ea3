"""``settled ops list|show|resubmit`` as a shell runs them, on PostgreSQL and SQLite, against
operations the executor really settled with the simulator: the list narrows by state, reason,
tenant and age and speaks the run report's words; show prints what the console's operation
page shows; a resubmission of an operation proven not done is a new operation through the
normal intake, sent once, linked both ways; every refusal is one line and writes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from outbox import runs
from outbox.errors import InvalidInput
from outbox.ids import derive_idempotency_key
from outbox.models import Operation, OperationEvent
from outbox.resubmit import RESUBMISSION, RESUBMITTED, resubmit
from outbox.storage.operations import find_operation
from settled.cli import main
from support.operation_view import operation_page
from tests.support.rig import GOOD, HOLD, Rig

#: the test settings' secrets (``tests/conftest.py``), so that the command's intake and the
#: rig's executor agree on fingerprints
FINGERPRINT_KEYS = '{"v1": "test-fingerprint-key-0001"}'
IDEMPOTENCY_SECRET = "test-idempotency-secret"


def settled(
    rig: Rig, *args: str | bytes, env_more: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``settled ARGS`` on the rig's database (and ``env_more``), as a shell runs it but in
    this process (click's runner): each run is a whole command line, its settings read from
    the environment (no ``SETTLED_`` variable of the test run's), at a fraction of a process's
    start. A ``bytes`` argument arrives as Python's argv holds it (``os.fsdecode``)."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SETTLED_")}
    env.update(
        SETTLED_DATABASE_URL=rig.engine.url.render_as_string(hide_password=False),
        SETTLED_DOWNSTREAM_URL=rig.url,
        SETTLED_FINGERPRINT_KEYS=FINGERPRINT_KEYS,
        SETTLED_IDEMPOTENCY_SECRET=IDEMPOTENCY_SECRET,
        **(env_more or {}),
    )
    argv = [os.fsdecode(a) for a in args]
    done = CliRunner().invoke(main, argv, env=env, catch_exceptions=False)
    return subprocess.CompletedProcess(argv, done.exit_code, done.stdout, done.stderr)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def one_line_error(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ")
    return line


def not_executed(rig: Rig, op_id: str, **kw: object) -> int:
    """An operation rejected as not executed: its deadline passed before any send."""
    op = rig.enqueue(op_id, **kw)
    rig.set(op, deadline=datetime.now(UTC) - timedelta(seconds=1))
    rig.executor().execute([op])
    assert (rig.op(op).state, rig.op(op).reason) == ("rejected", "not_executed")
    return op


def succeeded(rig: Rig, op_id: str) -> int:
    op = rig.enqueue(op_id, params={**GOOD, "amount_minor": 100})
    rig.executor().execute([op])
    assert rig.op(op).state == "succeeded"
    return op


def in_review(rig: Rig, op_id: str) -> int:
    """An operation left unknown with an open review item (its lookup down for too long)."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue(op_id, params={**GOOD, "amount_minor": 200})
    rig.executor().execute([op])
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    assert rig.reconciler().run_once().outcomes == {"to_review": 1}
    return op


def written(rig: Rig) -> tuple[int, int]:
    """Rows a refused action could have written: operations and events."""
    with rig.sessions() as s:
        return (
            s.scalar(select(func.count()).select_from(Operation)) or 0,
            s.scalar(select(func.count()).select_from(OperationEvent)) or 0,
        )


def events(rig: Rig, op: int) -> list[OperationEvent]:
    with rig.sessions() as s:
        stmt = select(OperationEvent).where(OperationEvent.operation_id == op)
        return list(s.scalars(stmt.order_by(OperationEvent.id)))


# -- list ------------------------------------------------------------------------------------


def test_list_narrows_by_state_reason_tenant_and_age_in_the_reports_words(rig: Rig) -> None:
    old = not_executed(rig, "op-old")
    rig.set(old, created_at=datetime.now(UTC) - timedelta(hours=2))
    not_executed(rig, "op-young")
    succeeded(rig, "op-done")
    with rig.sessions.begin() as s:
        rig.outbox.enqueue(s, tenant="t2", op_id="op-other", kind="refund", params=GOOD)

    out = ok(settled(rig, "ops", "list", "--state", "rejected", "--reason", "not_executed",
                     "--tenant", "acme", "--older-than", "1h", "--limit", "50"))  # fmt: skip
    header, *rows, count = out.splitlines()
    assert header.split() == ["AGE", "TENANT", "OP_ID", "KIND", "STATE", "GROUP", "REPORT"]
    (row,) = rows
    assert row.split()[:6] == ["2", "h", "0", "min", "acme", "op-old"]
    assert "rejected/not_executed" in row and " not done " in row
    assert row.endswith(
        "Operation op-old (refund of 100.00 CNY) was not done: it could not be sent in time."
    )
    assert count == "1 operation(s)"

    listed = json.loads(ok(settled(rig, "ops", "list", "--state", "rejected", "--json")))
    assert [r["op_id"] for r in listed] == ["op-old", "op-young"]  # oldest first
    assert {r["report"]["group"] for r in listed} == {"not_done"}
    assert listed[0]["report"]["text"]["zh"].startswith("操作 op-old（refund，100.00 CNY）未完成")
    assert listed[0]["age_seconds"] >= 7200 > listed[1]["age_seconds"]

    other = json.loads(ok(settled(rig, "ops", "list", "--tenant", "t2", "--json")))
    assert [(r["op_id"], r["state"], r["report"]["group"]) for r in other] == [
        ("op-other", "planned", "not_done")
    ]
    done = json.loads(ok(settled(rig, "ops", "list", "--state", "succeeded", "--json")))
    assert [r["op_id"] for r in done] == ["op-done"]
    assert len(json.loads(ok(settled(rig, "ops", "list", "--limit", "2", "--json")))) == 2


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--state", "lost"), "--state"),
        (("--reason", "tired"), "--reason"),
        (("--older-than", "1 week"), "--older-than"),
        (("--older-than", "-5m"), "--older-than"),
        (("--limit", "0"), "--limit"),
        (("--tenant", b"ac\xffme"), "--tenant"),
    ],
    ids=["state", "reason", "age-words", "age-negative", "limit", "tenant-bytes"],
)
def test_a_list_with_bad_filters_is_one_usage_line(
    rig: Rig, args: tuple[str | bytes, ...], names: str
) -> None:
    rig.judged_by_ledger = False  # nothing is sent
    result = settled(rig, "ops", "list", *args)  # type: ignore[arg-type]
    assert names in one_line_error(result, 2)


def test_a_reason_with_another_state_is_refused(rig: Rig) -> None:
    rig.judged_by_ledger = False
    line = one_line_error(settled(rig, "ops", "list", "--state", "planned", "--reason",
                                  "not_executed"))  # fmt: skip
    assert "[invalid_reason]" in line


# -- show ------------------------------------------------------------------------------------


def test_show_prints_the_report_and_the_timeline_as_the_console_does(rig: Rig) -> None:
    op = succeeded(rig, "op-done")
    out = ok(settled(rig, "ops", "show", "acme", "op-done"))
    lines = out.splitlines()
    assert lines[0] == "Operation op-done of acme"
    ref = rig.op(op).downstream_ref
    assert lines[1] == f"done: Operation op-done (refund of 1.00 CNY) is done (receipt {ref})."
    assert "  amount           1.00 CNY" in lines
    assert "  state            succeeded" in lines
    attempts = lines[lines.index("Attempts") + 1 :][:2]
    assert attempts[0].split() == ["#", "REQUESTED", "FINISHED", "OUTCOME", "HTTP", "DETAIL"]
    assert attempts[1].split()[0] == "1" and attempts[1].split()[3] == "done"
    timeline = lines[lines.index("Events") + 2 :]
    assert [e.split()[1:4] for e in timeline] == [
        ["-", "planned", "intake"], ["planned", "submitted", "w1"], ["submitted", "succeeded", "w1"]
    ]  # fmt: skip
    # no secret of the service: its API key, the keys behind fingerprints and idempotency keys
    for secret in (rig.tenant.api_key.get_secret_value(), "test-fingerprint-key-0001",
                   IDEMPOTENCY_SECRET, rig.op(op).fingerprint):  # fmt: skip
        assert secret not in out

    shown = json.loads(ok(settled(rig, "ops", "show", "acme", "op-done", "--json")))
    with rig.sessions() as s:
        found = find_operation(s, "acme", "op-done")
        assert found is not None
        console = json.loads(json.dumps(operation_page(s, found)))
    assert shown == console  # the console's operation page, word for word
    assert "zh" in shown["report"]["text"] and shown["review_item"] is None


def test_show_names_the_review_item_of_an_operation_in_review(rig: Rig) -> None:
    in_review(rig, "op-r")
    out = ok(settled(rig, "ops", "show", "acme", "op-r", "--lang", "zh"))
    assert out.splitlines()[1].startswith("uncertain: 操作 op-r（refund，2.00 CNY）的结果仍待确认")
    assert out.splitlines()[2].startswith("in review: item #")


def test_show_of_a_missing_operation_is_one_line(rig: Rig) -> None:
    rig.judged_by_ledger = False
    for args in (("acme", "op-none"), ("acme", "bad op id!"), ("ACME", "op-1")):
        assert "[operation_not_found]" in one_line_error(settled(rig, "ops", "show", *args))


# -- resubmit --------------------------------------------------------------------------------


def test_resubmit_sends_the_intent_again_once_under_the_new_op_id(rig: Rig) -> None:
    original = not_executed(rig, "op-1")
    out = ok(settled(rig, "ops", "resubmit", "acme", "op-1", "--new-op-id", "op-1-again",
                     "--by", "alice", "--reason", "the payment service was down"))  # fmt: skip
    assert out == "resubmitted acme/op-1 as op-1-again (planned)\n"
    with rig.sessions() as s:
        new = find_operation(s, "acme", "op-1-again")
    assert new is not None
    first = rig.op(original)
    assert (new.kind, new.params, new.state) == (first.kind, first.params, "planned")
    assert new.idempotency_key == derive_idempotency_key(
        IDEMPOTENCY_SECRET.encode(), "acme", "op-1-again"
    )
    assert new.idempotency_key != first.idempotency_key
    assert new.deadline > datetime.now(UTC)  # a budget of its own
    (*_, note) = events(rig, original)
    assert (note.reason, note.actor, note.from_state, note.to_state) == (
        RESUBMITTED, "staff:alice", "rejected", "rejected"
    )  # fmt: skip
    assert note.evidence == {"resubmitted_as": "op-1-again", "by": "alice",
                             "why": "the payment service was down"}  # fmt: skip
    created, link = events(rig, new.id)
    assert created.reason is None and created.to_state == "planned"
    assert (link.reason, link.actor) == (RESUBMISSION, "staff:alice")
    assert link.evidence == {"resubmits": "op-1", "by": "alice",
                             "why": "the payment service was down"}  # fmt: skip

    rig.executor().execute([new.id])
    assert rig.op(new.id).state == "succeeded"
    assert (rig.effects(new.id), rig.effects(original)) == (1, 0)

    # the same command again answers with the operation it made, writing nothing
    before = written(rig)
    again = ok(settled(rig, "ops", "resubmit", "acme", "op-1", "--new-op-id", "op-1-again",
                       "--by", "alice", "--reason", "the payment service was down"))  # fmt: skip
    assert again == "already resubmitted acme/op-1 as op-1-again (succeeded)\n"
    assert written(rig) == before
    shown = ok(settled(rig, "ops", "show", "acme", "op-1"))
    assert "resubmitted" in shown and "op-1-again" in shown


def test_resubmit_of_an_operation_of_a_cancelled_run_leaves_the_run(rig: Rig) -> None:
    with rig.sessions.begin() as s:
        run = runs.open_run(s, tenant="acme", title="refunds")
        rig.outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run)
        handle = run.handle
    with rig.sessions.begin() as s:
        runs.cancel_run(s, "acme", handle, actor="user")
    args = ("--new-op-id", "op-2", "--by", "bob", "--reason", "asked again", "--json")
    done = json.loads(ok(settled(rig, "ops", "resubmit", "acme", "op-1", *args)))
    assert done == {"original": "op-1", "op_id": "op-2", "state": "planned", "created": True,
                    "run": None}  # fmt: skip
    with rig.sessions() as s:
        new = find_operation(s, "acme", "op-2")
        assert new is not None and new.run_id is None


def test_resubmit_of_an_operation_of_a_live_run_joins_the_run(rig: Rig) -> None:
    with rig.sessions.begin() as s:
        run = runs.open_run(s, tenant="acme")
        handle = run.handle
    op = not_executed(rig, "op-1", run=run)
    args = ("--new-op-id", "op-2", "--by", "bob", "--reason", "again", "--json")
    done = json.loads(ok(settled(rig, "ops", "resubmit", "acme", "op-1", *args)))
    assert done["run"] == handle
    with rig.sessions() as s:
        new = find_operation(s, "acme", "op-2")
        assert new is not None and new.run_id == rig.op(op).run_id


def _staff_rejected(rig: Rig) -> None:
    op = not_executed(rig, "op-1")
    rig.set(op, receipt={"source": "staff", "staff": "carol", "status": "rejected"})


def _resubmitted(rig: Rig) -> None:
    not_executed(rig, "op-1")
    ok(settled(rig, "ops", "resubmit", "acme", "op-1", "--new-op-id", "op-first", "--by",
               "alice", "--reason", "first"))  # fmt: skip


REFUSALS = {
    "succeeded": (lambda rig: succeeded(rig, "op-1"), (), "[done]"),
    "planned": (lambda rig: rig.enqueue("op-1"), (), "[not_settled]"),
    "in-review": (lambda rig: in_review(rig, "op-1"), (), "[in_review]"),
    "staff-statement": (_staff_rejected, (), "[unproven]"),
    "resubmitted-already": (_resubmitted, (), "[already_resubmitted]"),
    "new-id-taken": (lambda rig: (not_executed(rig, "op-1"), rig.enqueue("op-2")), (),
                     "[op_id_taken]"),
    "same-id": (lambda rig: not_executed(rig, "op-1"), ("--new-op-id", "op-1"), "[same_op_id]"),
    "missing": (lambda rig: None, (), "[operation_not_found]"),
    "bad-new-id": (lambda rig: not_executed(rig, "op-1"), ("--new-op-id", "op 2!"),
                   "[invalid_new_op_id]"),
    "blank-by": (lambda rig: not_executed(rig, "op-1"), ("--by", " "), "[invalid_by]"),
    "blank-reason": (lambda rig: not_executed(rig, "op-1"), ("--reason", ""), "[invalid_reason]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_resubmit_that_may_not_be_is_one_line_and_writes_nothing(rig: Rig, case: str) -> None:
    setup, override, code = REFUSALS[case]
    setup(rig)
    options = {"--new-op-id": "op-2", "--by": "alice", "--reason": "try again"}
    options.update(dict(zip(override[::2], override[1::2], strict=True)))
    before = written(rig)
    args = [word for pair in options.items() for word in pair]
    line = one_line_error(settled(rig, "ops", "resubmit", "acme", "op-1", *args))
    assert code in line
    assert written(rig) == before


def test_two_resubmissions_of_one_original_at_once_make_one_operation(rig: Rig) -> None:
    not_executed(rig, "op-1")
    start = threading.Barrier(2)
    results: dict[str, str] = {}

    def attempt(new: str) -> None:
        start.wait()
        try:
            with rig.sessions.begin() as s:
                resubmit(rig.outbox, s, tenant="acme", op_id="op-1", new_op_id=new,
                         by="alice", why="race")  # fmt: skip
            results[new] = "made"
        except InvalidInput as exc:
            results[new] = exc.code

    threads = [threading.Thread(target=attempt, args=(n,)) for n in ("op-a", "op-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results.values()) == ["already_resubmitted", "made"]
    with rig.sessions() as s:
        made = [n for n in ("op-a", "op-b") if find_operation(s, "acme", n) is not None]
    assert made == [n for n, r in results.items() if r == "made"]
