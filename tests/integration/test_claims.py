"""A claim takes at most ``limit`` operations, whatever plan the database picks for it.

On PostgreSQL, ``UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`` may be
planned as a nested-loop semi-join that runs the sub-select again for every row of the outer
scan, and then updates every due row (seen: LIMIT 8 claimed 300). PostgreSQL picked that plan
for a table without statistics (a new deployment, before autovacuum's first ANALYZE). Each test
runs on both databases, with and without statistics.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from outbox.intake import Outbox
from outbox.models import Operation
from outbox.states import State
from outbox.storage.claims import claim_for_send, claim_unresolved, due_ids
from tests.support.rig import GOOD


@pytest.fixture(params=["no statistics", "analyzed"])
def stats(request: pytest.FixtureRequest) -> bool:
    """Whether the tables have statistics when the claims run."""
    return request.param == "analyzed"


def fill(engine: Engine, outbox: Outbox, n: int, stats: bool) -> list[int]:
    with Session(engine) as s, s.begin():
        ids = [
            outbox.enqueue(
                s, tenant="acme", kind="refund", params=GOOD, op_id=f"op-{i}"
            ).operation.id
            for i in range(n)
        ]
    if stats:
        analyze(engine)
    return ids


def analyze(engine: Engine) -> None:
    """Table statistics, as autovacuum gathers them on a live system."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE")


def leased(engine: Engine) -> int:
    with Session(engine) as s:
        return s.scalar(select(func.count()).where(Operation.lease_owner.is_not(None))) or 0


def test_claiming_due_operations_takes_at_most_the_limit(
    engine: Engine, outbox: Outbox, stats: bool
) -> None:
    ids = fill(engine, outbox, 300, stats)
    with Session(engine) as s, s.begin():
        claimed = claim_for_send(s, worker="w1", lease_seconds=30, extra=8)
    assert len(claimed) == 8
    assert leased(engine) == 8
    # the oldest first
    assert [c.id for c in claimed] == ids[:8]


def test_hinted_and_extra_claims_add_up_to_the_hint_and_the_limit(
    engine: Engine, outbox: Outbox, stats: bool
) -> None:
    ids = fill(engine, outbox, 300, stats)
    with Session(engine) as s, s.begin():
        claimed = claim_for_send(s, worker="w1", lease_seconds=30, ids=ids[-3:], extra=5)
    assert len(claimed) == 8
    assert {c.id for c in claimed} >= set(ids[-3:])
    assert leased(engine) == 8


def test_claiming_unresolved_operations_takes_at_most_the_limit(
    engine: Engine, outbox: Outbox, stats: bool
) -> None:
    fill(engine, outbox, 300, stats)
    past = datetime.now(UTC) - timedelta(minutes=1)
    with Session(engine) as s, s.begin():
        s.execute(
            update(Operation).values(
                state=State.UNKNOWN.value, next_attempt_at=past, unknown_since=past
            )
        )
    if stats:
        analyze(engine)
    with Session(engine) as s, s.begin():
        claimed = claim_unresolved(s, worker="r1", lease_seconds=30, limit=5)
    assert len(claimed) == 5
    assert leased(engine) == 5


def test_a_claimed_operation_is_not_due_for_another_claim(
    engine: Engine, outbox: Outbox, stats: bool
) -> None:
    ids = fill(engine, outbox, 20, stats)
    with Session(engine) as s, s.begin():
        first = claim_for_send(s, worker="w1", lease_seconds=30, extra=8)
    with Session(engine) as s, s.begin():
        second = claim_for_send(s, worker="w2", lease_seconds=30, extra=8)
        due = due_ids(s, limit=100)
    assert {c.id for c in second}.isdisjoint(c.id for c in first)
    assert len(second) == 8
    assert set(due) == set(ids) - {c.id for c in first} - {c.id for c in second}


def test_a_hint_whose_operations_were_taken_claims_no_others(
    engine: Engine, outbox: Outbox, stats: bool
) -> None:
    """Its operations went as another claim's extras: that worker is on the backlog already,
    and this hint costs one statement."""
    ids = fill(engine, outbox, 20, stats)
    with Session(engine) as s, s.begin():
        first = claim_for_send(s, worker="w1", lease_seconds=30, ids=ids[:1], extra=8)
    assert len(first) == 9
    with Session(engine) as s, s.begin():
        taken = claim_for_send(s, worker="w2", lease_seconds=30, ids=[first[-1].id], extra=8)
        mixed = claim_for_send(
            s, worker="w2", lease_seconds=30, ids=[first[-1].id, ids[-1]], extra=2
        )
    assert taken == []
    assert [c.id for c in mixed][:1] == [ids[-1]]
    assert len(mixed) == 3
    assert leased(engine) == 12
