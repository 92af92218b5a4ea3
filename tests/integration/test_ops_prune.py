"""``settled ops prune`` (and ``outbox.prune.prune``) on PostgreSQL and SQLite: terminal
operations untouched for longer than the age go with their events, attempts and review items,
archived first when asked; nothing live, in review, in a run still going, compensated by
something that stays, or touched lately; a dry run deletes and writes nothing; bad input is
one line and deletes nothing.
"""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from outbox import runs
from outbox.errors import InvalidInput
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem, Run
from outbox.prune import prune
from outbox.resubmit import resubmit
from tests.integration.test_ops_cli import not_executed, ok, one_line_error, settled, succeeded
from tests.support.rig import GOOD, Rig

OLD = timedelta(days=100)
#: what the scenario prunes at 90 days
PRUNED = {"op-done", "op-rejected", "op-run2-a", "op-run2-b", "op-orig-2", "op-comp-2"}


def age(rig: Rig, ids: list[int], by: timedelta = OLD) -> None:
    """Make these operations, their events and their attempts ``by`` old."""
    then = datetime.now(UTC) - by
    with rig.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id.in_(ids))
                  .values(created_at=then, updated_at=then))  # fmt: skip
        s.execute(update(OperationEvent).where(OperationEvent.operation_id.in_(ids))
                  .values(at=then))  # fmt: skip
        s.execute(update(Attempt).where(Attempt.operation_id.in_(ids))
                  .values(started_at=then, not_after=then, finished_at=then))  # fmt: skip


def compensation(rig: Rig, op_id: str, original: int) -> int:
    with rig.sessions.begin() as s:
        offsets = s.get(Operation, original)
        params = {**GOOD, "amount_minor": 100}
        got = rig.outbox.enqueue(
            s, tenant="acme", op_id=op_id, kind="refund", params=params, compensates=offsets
        )
        return got.operation.id


def scenario(rig: Rig) -> dict[str, int]:
    """Operations of every kind prune must tell apart; their op ids and ids."""
    ids: dict[str, int] = {}
    ids["op-done"] = succeeded(rig, "op-done")
    ids["op-rejected"] = not_executed(rig, "op-rejected")
    ids["op-young"] = not_executed(rig, "op-young")
    ids["op-live"] = rig.enqueue("op-live", params={**GOOD, "amount_minor": 300})
    ids["op-in-review"] = not_executed(rig, "op-in-review")
    with rig.sessions.begin() as s:
        s.add(ReviewItem(operation_id=ids["op-in-review"], tenant="acme", reason="staff_check",
                         evidence={}))  # fmt: skip
        run1, run2 = runs.open_run(s, tenant="acme"), runs.open_run(s, tenant="acme")
    ids["op-run1-done"] = not_executed(rig, "op-run1-done", run=run1)
    ids["op-run1-live"] = rig.enqueue("op-run1-live", params={**GOOD, "amount_minor": 400},
                                      run=run1)  # fmt: skip
    ids["op-run2-a"] = not_executed(rig, "op-run2-a", run=run2)
    ids["op-run2-b"] = not_executed(rig, "op-run2-b", run=run2)
    ids["op-orig-1"] = succeeded(rig, "op-orig-1")
    ids["op-comp-1"] = compensation(rig, "op-comp-1", ids["op-orig-1"])  # live: planned
    ids["op-orig-2"] = succeeded(rig, "op-orig-2")
    ids["op-comp-2"] = compensation(rig, "op-comp-2", ids["op-orig-2"])
    with rig.sessions.begin() as s:
        comp = s.get(Operation, ids["op-comp-2"])
        assert comp is not None
        comp.deadline = datetime.now(UTC) - timedelta(seconds=1)
    rig.executor().execute([ids["op-comp-2"]])
    assert rig.op(ids["op-comp-2"]).state == "rejected"
    ids["op-touched"] = not_executed(rig, "op-touched")
    age(rig, [i for name, i in ids.items() if name != "op-young"])
    with rig.sessions.begin() as s:  # an event today: a resubmission
        resubmit(rig.outbox, s, tenant="acme", op_id="op-touched", new_op_id="op-touched-2",
                 by="alice", why="again")  # fmt: skip
    return ids


def counts(rig: Rig) -> dict[str, int]:
    with rig.sessions() as s:
        return {
            model.__tablename__: s.scalar(select(func.count()).select_from(model)) or 0
            for model in (Operation, OperationEvent, Attempt, ReviewItem, Run)
        }


def events_of(rig: Rig, ids: list[int]) -> int:
    with rig.sessions() as s:
        stmt = select(func.count()).where(OperationEvent.operation_id.in_(ids))
        return s.scalar(stmt) or 0


def op_ids(rig: Rig) -> set[str]:
    with rig.sessions() as s:
        return set(s.scalars(select(Operation.op_id)))


def test_prune_deletes_only_what_nothing_holds_and_archives_it_first(
    rig: Rig, tmp_path: Path
) -> None:
    ids = scenario(rig)
    everything = op_ids(rig)
    gone_events = events_of(rig, [ids[name] for name in PRUNED])
    before = counts(rig)

    dry = prune(rig.engine, timedelta(days=90), dry_run=True)
    assert (dry.operations, dry.events, dry.runs) == (len(PRUNED), gone_events, 1)
    line = f"would prune 6 operations and {gone_events} events older than 90 days"
    assert ok(settled(rig, "ops", "prune", "--older-than", "90", "--dry-run",
                      "--batch-size", "1")) == line + "\n"  # fmt: skip
    assert counts(rig) == before

    archive = tmp_path / "pruned.jsonl"
    out = ok(settled(rig, "ops", "prune", "--older-than", "90", "--archive", str(archive),
                     "--batch-size", "1"))  # fmt: skip
    assert out == f"pruned 6 operations and {gone_events} events older than 90 days\n"
    assert op_ids(rig) == everything - PRUNED
    after = counts(rig)
    assert after["operations"] == before["operations"] - 6
    assert after["operation_events"] == before["operation_events"] - gone_events
    assert after["attempts"] == before["attempts"] - 2  # op-done and op-orig-2 were sent
    assert after["runs"] == before["runs"] - 1  # run 2, emptied; run 1 still goes on
    assert after["review_items"] == before["review_items"]

    lines = [json.loads(text) for text in archive.read_text().splitlines()]
    assert {line["operation"]["op_id"] for line in lines} == PRUNED
    by_op = {line["operation"]["op_id"]: line for line in lines}
    assert len(by_op["op-done"]["events"]) == 3 and len(by_op["op-done"]["attempts"]) == 1
    assert by_op["op-run2-a"]["run"]["id"] == by_op["op-run2-b"]["run"]["id"]
    assert by_op["op-comp-2"]["operation"]["compensates_id"] == ids["op-orig-2"]
    assert sum(len(line["events"]) for line in lines) == gone_events
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600

    again = ok(settled(rig, "ops", "prune", "--older-than", "90", "--json"))
    assert json.loads(again)["operations"] == 0


def test_prune_by_age_keeps_what_is_younger(rig: Rig) -> None:
    old, young = not_executed(rig, "op-old"), not_executed(rig, "op-young")
    age(rig, [old], timedelta(days=3))
    age(rig, [young], timedelta(days=1, hours=12))
    assert ok(settled(rig, "ops", "prune", "--older-than", "2")).startswith(
        "pruned 1 operations and 2 events older than 2 days"
    )
    assert op_ids(rig) == {"op-young"}


@pytest.mark.parametrize(
    ("args", "status", "names"),
    [
        (("--older-than", "0"), 2, "--older-than"),
        (("--older-than", "ninety"), 2, "--older-than"),
        (("--older-than", "90", "--batch-size", "0"), 2, "--batch-size"),
        (("--older-than", "90", "--dry-run", "--archive", "x.jsonl"), 1, "[invalid_archive]"),
        (("--older-than", "90", "--archive", "/nonexistent/dir/x.jsonl"), 1, "[invalid_archive]"),
    ],
    ids=["zero-days", "words", "batch-size", "dry-run-archive", "unwritable-archive"],
)
def test_a_prune_with_bad_input_is_one_line_and_deletes_nothing(
    rig: Rig, args: tuple[str, ...], status: int, names: str
) -> None:
    age(rig, [not_executed(rig, "op-old")])
    before = counts(rig)
    assert names in one_line_error(settled(rig, "ops", "prune", *args), status)
    assert counts(rig) == before


def test_the_python_function_refuses_bad_input(rig: Rig) -> None:
    rig.judged_by_ledger = False
    for kw in ({"older_than": timedelta(0)}, {"older_than": 90}):
        with pytest.raises(InvalidInput):
            prune(rig.engine, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        prune(rig.engine, timedelta(days=1), batch_size=0)
