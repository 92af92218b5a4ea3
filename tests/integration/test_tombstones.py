"""Tombstones on PostgreSQL and SQLite: ``settled ops prune`` keeps one per operation it
deletes, written with the delete; a replay of a pruned ``(tenant, op_id)`` is answered from
it (the same parameters: the replay, with no operation id; others: a conflict) and writes
nothing; a prune and an intake of the same op_id at once never make a second operation; only
``settled ops prune-tombstones``, confirmed, deletes tombstones, and then an intake of that
op_id is a new operation again (what its warning says).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session

from outbox.errors import IdempotencyConflict, InvalidInput, NotFound
from outbox.intake import CREATED_KEY, Enqueued, Outbox
from outbox.models import Operation, OperationEvent, OperationTombstone
from outbox.prune import prune
from outbox.resubmit import resubmit
from outbox.storage import prune as prune_store
from outbox.storage.operations import db_time
from outbox.tombstones import prune_tombstones
from tests.integration.test_intake import statements
from tests.integration.test_ops_cli import not_executed, ok, one_line_error, settled, succeeded
from tests.integration.test_ops_prune import age
from tests.support.contend import DEADLINE, Contender, contender
from tests.support.rig import GOOD, Rig
from tests.support.services import wait_until

AGE = timedelta(days=90)
PAID = {**GOOD, "amount_minor": 100}  # what ``succeeded`` refunds
TICKET = {"ticket_id": "T1", "order_id": "A1042", "reason": "damaged"}


def replay(outbox: Outbox, engine: Engine, op_id: str, params: dict[str, Any]) -> Enqueued:
    """``op_id`` enqueued again, committed; what intake answered (the session's list of
    operations to hint checked empty)."""
    with Session(engine) as s, s.begin():
        got = outbox.enqueue(s, tenant="acme", op_id=op_id, kind="refund", params=params)
        assert s.info.get(CREATED_KEY, []) == ([got.id] if got.created else [])
        return got


def rows(engine: Engine) -> tuple[int, int, int]:
    """(operations, operation events, tombstones)."""
    with Session(engine) as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(model)) or 0)
            for model in (Operation, OperationEvent, OperationTombstone)
        )


def tombstone(engine: Engine, op_id: str) -> OperationTombstone | None:
    with Session(engine) as s:
        return s.get(OperationTombstone, ("acme", op_id))


def finished(engine: Engine, outbox: Outbox, op_id: str, reference: str = "re_1") -> int:
    """An operation made succeeded by hand (nothing sent), 100 days old: for the races, where
    no downstream is wanted."""
    with Session(engine) as s, s.begin():
        got = outbox.enqueue(s, tenant="acme", op_id=op_id, kind="refund", params=GOOD)
        assert got.id is not None
        then = datetime.now(UTC) - timedelta(days=100)
        done = {"state": "succeeded", "downstream_ref": reference}
        s.execute(update(Operation).where(Operation.id == got.id)
                  .values(**done, created_at=then, updated_at=then))  # fmt: skip
        s.execute(update(OperationEvent).where(OperationEvent.operation_id == got.id)
                  .values(at=then))  # fmt: skip
        return got.id


def test_a_prune_keeps_a_tombstone_of_each_operation_it_deletes(rig: Rig) -> None:
    done, refused = succeeded(rig, "op-done"), not_executed(rig, "op-refused")
    live = rig.enqueue("op-live", params={**GOOD, "amount_minor": 300})
    age(rig, [done, refused, live])
    kept = {i: rig.op(i) for i in (done, refused)}

    assert prune(rig.engine, AGE, dry_run=True).operations == 2
    assert rows(rig.engine)[2] == 0  # a dry run writes no tombstone
    with Session(rig.engine) as s:
        before = db_time(s)
    assert prune(rig.engine, AGE).operations == 2

    with Session(rig.engine) as s:
        tombs = {t.op_id: t for t in s.scalars(select(OperationTombstone))}
    assert set(tombs) == {"op-done", "op-refused"}  # none for the live one, which stays
    for op in kept.values():
        t = tombs[op.op_id]
        assert (t.tenant, t.kind, t.fingerprint, t.fingerprint_key_version) == (
            op.tenant, op.kind, op.fingerprint, op.fingerprint_key_version)  # fmt: skip
        assert (t.state, t.reason, t.downstream_ref, t.idempotency_key, t.created_at) == (
            op.state, op.reason, op.downstream_ref, op.idempotency_key, op.created_at)  # fmt: skip
        assert t.pruned_at >= before  # the prune's database time
    assert kept[done].downstream_ref is not None  # the receipt's, kept
    assert (tombs["op-refused"].state, tombs["op-refused"].reason) == ("rejected", "not_executed")


def test_a_replay_of_a_pruned_operation_is_answered_from_its_tombstone(rig: Rig) -> None:
    done = succeeded(rig, "op-done")
    reference, key = rig.op(done).downstream_ref, rig.op(done).idempotency_key
    age(rig, [done])
    prune(rig.engine, AGE)
    before = rows(rig.engine)

    with statements(rig.engine) as seen:
        got = replay(rig.outbox, rig.engine, "op-done", PAID)

    # the INSERT that inserted nothing (it saw the tombstone), no operation, the tombstone
    first = "WITH" if rig.engine.dialect.name == "postgresql" else "INSERT"
    assert seen == [first, "SELECT", "SELECT"]

    assert (got.created, got.state, got.op_id) == (False, "succeeded", "op-done")
    assert (got.id, got.deadline, got.run_id, got.idempotency_key) == (None, None, None, key)
    tomb = got.pruned
    assert tomb is not None
    assert (tomb.state, tomb.reason, tomb.reference, tomb.kind) == (
        "succeeded", None, reference, "refund")  # fmt: skip
    with pytest.raises(NotFound) as gone:
        got.operation  # noqa: B018
    assert gone.value.code == "operation_pruned"
    assert rows(rig.engine) == before  # no operation, no event, the tombstone untouched
    assert rig.control.effects("acme", key) == 1  # refunded once, whatever the app resends
    # and an operator asking about it is told so
    line = one_line_error(settled(rig, "ops", "show", "acme", "op-done"))
    assert f"it was succeeded, reference {reference};" in line and "[operation_pruned]" in line


def test_another_intent_under_a_pruned_op_id_is_a_conflict_and_writes_nothing(
    rig: Rig,
) -> None:
    age(rig, [not_executed(rig, "op-refused")])
    prune(rig.engine, AGE)
    before = rows(rig.engine)
    for kind, params in (("refund", {**GOOD, "amount_minor": 1}), ("after_sales_ticket", TICKET)):
        with Session(rig.engine) as s, s.begin():
            with pytest.raises(IdempotencyConflict) as refused:
                rig.outbox.enqueue(s, tenant="acme", op_id="op-refused", kind=kind,
                                   params=params)  # fmt: skip
            assert refused.value.code == "idempotency_conflict"
    assert rows(rig.engine) == before
    # another tenant's op_id is another operation
    with Session(rig.engine) as s, s.begin():
        other = rig.outbox.enqueue(s, tenant="other", op_id="op-refused", kind="refund",
                                   params=GOOD)  # fmt: skip
        assert other.created
        s.rollback()


def test_a_resubmission_under_a_pruned_op_id_is_refused(rig: Rig) -> None:
    age(rig, [not_executed(rig, "op-old")])
    prune(rig.engine, AGE)
    not_executed(rig, "op-again")
    before = rows(rig.engine)
    with Session(rig.engine) as s, s.begin(), pytest.raises(IdempotencyConflict) as refused:
        resubmit(rig.outbox, s, tenant="acme", op_id="op-again", new_op_id="op-old", by="alice",
                 why="again")  # fmt: skip
    assert refused.value.code == "op_id_taken"
    assert rows(rig.engine) == before


# -- a prune and an intake of the same op_id at once --------------------------------------


@pytest.fixture
def paused_prune(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The next prune's batch waits, its operations deleted and their tombstones written but
    not committed, until ``go`` is set; ``deleted`` is set when it gets there."""
    deleted, go = threading.Event(), threading.Event()
    original = prune_store.delete_operations

    def delete_then_wait(session: Session, ids: Any) -> Any:
        got = original(session, ids)
        deleted.set()
        assert go.wait(DEADLINE), "the test never let the prune commit"
        return got

    monkeypatch.setattr(prune_store, "delete_operations", delete_then_wait)
    yield deleted, go
    go.set()


def _intake_waits(engine: Engine, racer: Contender[Any]) -> bool:
    """The racing intake is blocked on the prune: on PostgreSQL its INSERT waits on a lock
    (the unique key of the row the prune deletes); on SQLite it asked for the write lock."""
    if engine.dialect.name == "sqlite":
        return racer.started.is_set()
    with engine.connect() as conn:
        waiting = conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND query LIKE '%INSERT INTO operations%'"
        )).scalar_one()  # fmt: skip
    return bool(waiting)


def test_an_intake_waiting_on_a_prune_of_its_op_id_is_answered_from_the_tombstone(
    engine: Engine, outbox: Outbox, paused_prune: tuple[threading.Event, threading.Event]
) -> None:
    # The interleaving that would make a second operation: the prune has deleted the row
    # (not committed), the intake's INSERT meets its unique key and waits; once the prune
    # commits, the key is free and the INSERT goes ahead, past a tombstone its snapshot
    # could not see. The intake must notice and answer the replay instead.
    finished(engine, outbox, "op-race", reference="re_race")
    deleted, go = paused_prune
    pruning = threading.Thread(target=prune, args=(engine, AGE), daemon=True)
    pruning.start()
    assert deleted.wait(DEADLINE)
    # one transaction: until it commits, others see the operation and no tombstone
    assert (rows(engine)[0], tombstone(engine, "op-race")) == (1, None)
    with contender(lambda: replay(outbox, engine, "op-race", GOOD)) as racer:
        racer.start()
        assert wait_until(lambda: _intake_waits(engine, racer), DEADLINE)
        go.set()
        pruning.join(DEADLINE)
        got = racer.result()
    assert not got.created and got.id is None
    assert got.pruned is not None and got.pruned.reference == "re_race"
    assert rows(engine) == (0, 0, 1)  # nothing of a new operation, not even its event


def race(engine: Engine, outbox: Outbox, op_id: str) -> Enqueued | BaseException:
    """A prune and an intake of ``op_id`` (its same intent) let go at once; the intake's
    answer (or what it raised)."""
    barrier = threading.Barrier(2, timeout=DEADLINE)
    answers: list[Enqueued | BaseException] = []

    def intake() -> None:
        barrier.wait()
        try:
            answers.append(replay(outbox, engine, op_id, GOOD))
        except BaseException as exc:  # judged by the caller
            answers.append(exc)

    def pruning() -> None:
        barrier.wait()
        prune(engine, AGE)

    threads = [threading.Thread(target=intake), threading.Thread(target=pruning)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive()
    (got,) = answers
    return got


def test_prunes_and_intakes_of_the_same_op_ids_at_once_never_make_a_second_operation(
    engine: Engine, outbox: Outbox
) -> None:
    for n in range(12):
        finished(engine, outbox, f"op-race-{n}")
        got = race(engine, outbox, f"op-race-{n}")
        assert isinstance(got, Enqueued), got
        assert not got.created  # the live operation's replay, or its tombstone's
        assert got.state == "succeeded"
        assert rows(engine) == (0, 0, n + 1), n  # every one pruned, none made again


# -- settled ops prune-tombstones -----------------------------------------------------------


def _age_tombstones(engine: Engine, op_ids: list[str], by: timedelta) -> None:
    with Session(engine) as s, s.begin():
        s.execute(update(OperationTombstone).where(OperationTombstone.op_id.in_(op_ids))
                  .values(pruned_at=datetime.now(UTC) - by))  # fmt: skip


def test_prune_tombstones_needs_confirming_and_reopens_only_the_old_op_ids(rig: Rig) -> None:
    old, young = not_executed(rig, "op-old"), not_executed(rig, "op-young")
    age(rig, [old, young])
    prune(rig.engine, AGE)
    _age_tombstones(rig.engine, ["op-old"], timedelta(days=400))

    refused = settled(rig, "ops", "prune-tombstones", "--older-than", "365")
    assert refused.returncode == 2
    assert "WARNING" in refused.stderr and "carried out a second time" in refused.stderr
    assert "--yes-replays-execute-again" in refused.stderr
    dry = settled(rig, "ops", "prune-tombstones", "--older-than", "365", "--dry-run")
    assert ok(dry) == "would delete 1 tombstones older than 365 days\n"
    assert "WARNING" in dry.stderr
    assert rows(rig.engine)[2] == 2

    done = ok(settled(rig, "ops", "prune-tombstones", "--older-than", "365",
                      "--yes-replays-execute-again", "--batch-size", "1"))  # fmt: skip
    assert done == "deleted 1 tombstones older than 365 days\n"
    assert tombstone(rig.engine, "op-old") is None
    assert tombstone(rig.engine, "op-young") is not None
    # What the warning says: the old op_id is open again, a new operation; the young one not.
    assert replay(rig.outbox, rig.engine, "op-old", GOOD).created
    assert replay(rig.outbox, rig.engine, "op-young", GOOD).pruned is not None
    rig.judged_by_ledger = False  # op-old, made again, is left planned: nothing was sent


def test_prune_tombstones_refuses_bad_input(engine: Engine) -> None:
    for kw in ({"older_than": timedelta(0)}, {"older_than": 90},
               {"older_than": AGE, "batch_size": 0}):  # fmt: skip
        with pytest.raises(InvalidInput):
            prune_tombstones(engine, **kw)  # type: ignore[arg-type]
