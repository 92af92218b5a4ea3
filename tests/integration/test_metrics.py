"""Prometheus metrics read from the database: every figure follows the rows, and a scrape reads
only the live part of the tables (partial indexes) and the events since the last scrape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import sessionmaker

from outbox.states import TERMINAL, State
from outbox.storage.metrics import GAPS_BETWEEN, OUTCOMES_OF, TRANSITIONS_OF
from settled.metrics import LIVE, EventCounters, registry
from tests.support.rig import GOOD, HOLD, Rig

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(reg: CollectorRegistry) -> Samples:
    text_ = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text_)
        for s in family.samples
    }


def test_metrics_follow_live_states_attempts_reviews_and_reconcile_results(rig: Rig) -> None:
    reg = registry(rig.sessions)
    ok = rig.enqueue("op-ok")
    lost = rig.enqueue("op-lost", {**GOOD, "amount_minor": 5})
    waiting = rig.enqueue("op-waiting", {**GOOD, "amount_minor": 6})
    rig.executor().execute([ok])
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD, times=1)
    rig.control.add_rule("lookup_unavailable")
    rig.executor().execute([lost])
    rig.set(lost, unknown_since=datetime.now(UTC) - timedelta(seconds=900))
    rig.reconciler().run_once()
    rig.set(waiting, next_attempt_at=datetime.now(UTC) - timedelta(seconds=120))

    m = scrape(reg)
    assert m[("settled_operations", (("state", "planned"),))] == 1
    assert m[("settled_operations", (("state", "unknown"),))] == 1
    assert m[("settled_operations", (("state", "submitted"),))] == 0
    assert m[("settled_attempts_total", (("outcome", "done"),))] == 1
    assert m[("settled_attempts_total", (("outcome", "unknown"),))] == 1
    assert m[("settled_review_queue_depth", ())] == 1
    assert 890 < m[("settled_oldest_unknown_age_seconds", ())] < 1200
    assert 110 < m[("settled_send_backlog_age_seconds", ())] < 300
    assert m[("settled_reconcile_results_total", (("result", "to_review"),))] == 1
    moved = {
        labels: value for (name, labels), value in m.items() if name == "settled_transitions_total"
    }
    assert moved == {
        (("from_state", "new"), ("to_state", "planned")): 3,
        (("from_state", "planned"), ("to_state", "submitted")): 2,
        (("from_state", "submitted"), ("to_state", "succeeded")): 1,
        (("from_state", "submitted"), ("to_state", "unknown")): 1,
        (("from_state", "unknown"), ("to_state", "unknown")): 1,
    }

    # The reconciler set the next look in the future: nothing waits for it yet; once that
    # moment has passed, the backlog's age says how long the operation has been waiting.
    assert m[("settled_reconcile_backlog_age_seconds", ())] == 0
    rig.set(lost, next_attempt_at=datetime.now(UTC) - timedelta(seconds=300))
    again = scrape(reg)
    assert 290 < again[("settled_reconcile_backlog_age_seconds", ())] < 600
    # counters do not count the same events twice
    assert again[("settled_attempts_total", (("outcome", "done"),))] == 1


def test_counters_count_the_events_since_the_process_started_not_before(rig: Rig) -> None:
    rig.executor().execute([rig.enqueue("op-before")])
    with rig.sessions.begin() as s:  # a minute ago, not a millisecond: no race with the start
        s.execute(text("UPDATE operation_events SET at = :at"), {"at": minute_ago()})
    reg = registry(rig.sessions)  # the process starts; its first scrape comes later
    rig.executor().execute([rig.enqueue("op-after", {**GOOD, "amount_minor": 5})])
    m = scrape(reg)
    assert m[("settled_attempts_total", (("outcome", "done"),))] == 1


def minute_ago() -> datetime:
    return datetime.now(UTC) - timedelta(seconds=60)


SUCCEEDED_EVENT = (
    "INSERT INTO operation_events (operation_id, from_state, to_state, actor, lease_version)"
    " VALUES (:id, 'submitted', 'succeeded', 'w9', 99)"
)


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_an_event_committed_after_a_later_one_was_counted_is_counted_once(rig: Rig) -> None:
    rig.judged_by_ledger = False  # events written by hand
    counters = EventCounters()
    op = rig.enqueue("op-1")
    with rig.sessions() as s:
        counters.advance(s, datetime.now(UTC))
    with rig.engine.connect() as slow:
        slow.execute(text(SUCCEEDED_EVENT), {"id": op})  # its id is taken, not committed
        rig.executor().execute([rig.enqueue("op-2", {**GOOD, "amount_minor": 5})])
        with rig.sessions() as s:
            counters.advance(s, datetime.now(UTC))
        assert counters.transitions[("submitted", "succeeded")] == 1
        assert counters.pending == 1
        slow.commit()
    for _ in range(2):
        with rig.sessions() as s:
            counters.advance(s, datetime.now(UTC))
    assert counters.transitions[("submitted", "succeeded")] == 2
    assert counters.pending == 0


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_the_id_of_a_rolled_back_event_is_given_up_after_the_patience(rig: Rig) -> None:
    rig.judged_by_ledger = False
    counters = EventCounters(patience=60)
    op = rig.enqueue("op-1")
    t0 = datetime.now(UTC)
    with rig.sessions() as s:
        counters.advance(s, t0)
    with rig.engine.connect() as doomed:
        doomed.execute(text(SUCCEEDED_EVENT), {"id": op})
        rig.executor().execute([rig.enqueue("op-2", {**GOOD, "amount_minor": 5})])
        doomed.rollback()
    with rig.sessions() as s:
        counters.advance(s, t0 + timedelta(seconds=1))
        assert counters.pending == 1
        counters.advance(s, t0 + timedelta(seconds=30))
        assert counters.pending == 1  # still looked for
        counters.advance(s, t0 + timedelta(seconds=62))
    assert counters.pending == 0
    assert counters.transitions[("submitted", "succeeded")] == 1


# -- the cost of a scrape (PostgreSQL plans) -----------------------------------------------

#: The partial indexes on the live part of the tables.
PARTIAL = {"ix_operations_due", "ix_operations_unresolved", "uq_review_items_open"}
GROWING = {"operations", "operation_events", "attempts", "review_items"}


def whole_table_reads(plan: dict[str, Any]) -> list[str]:
    """The nodes of ``plan`` that read a growing table whole: a sequential scan, or an index
    scan that is neither bounded by a condition nor on a partial index of live rows."""
    found: list[str] = []
    node_type = plan.get("Node Type", "")
    relation = plan.get("Relation Name")
    index = plan.get("Index Name")
    if relation in GROWING and node_type == "Seq Scan":
        found.append(f"Seq Scan on {relation}")
    if (
        index is not None
        and node_type in ("Index Scan", "Index Only Scan", "Bitmap Index Scan")
        and "Index Cond" not in plan
        and index not in PARTIAL
    ):
        found.append(f"{node_type} on {index} without a condition")
    for child in plan.get("Plans", []):
        found += whole_table_reads(child)
    return found


@pytest.fixture
def statements(rig: Rig) -> Iterator[list[tuple[str, Any]]]:
    """Every statement the rig's engine runs while the list is open, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def keep(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(rig.engine, "before_cursor_execute", keep)
    yield seen
    event.remove(rig.engine, "before_cursor_execute", keep)


def explain(engine: Engine, statement: str, parameters: Any) -> dict[str, Any]:
    """The plan PostgreSQL picks when sequential scans cost as much as it can make them."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        sql = f"EXPLAIN (FORMAT JSON) {statement}"
        raw = (
            conn.exec_driver_sql(sql, parameters) if parameters else conn.exec_driver_sql(sql)
        ).scalar()
        conn.rollback()
    plans = raw if isinstance(raw, list) else json.loads(raw)
    return plans[0]["Plan"]  # type: ignore[no-any-return]


def fill(rig: Rig, settled: int) -> None:
    """``settled`` finished operations, each with an attempt and an event, beside a few live
    ones: the history a scrape must not read."""
    rig.enqueue("op-template", {**GOOD, "amount_minor": 7})
    history = [
        "INSERT INTO operations (tenant, op_id, kind, params, fingerprint,"
        " fingerprint_key_version, idempotency_key, state, attempts, max_attempts, deadline,"
        " next_attempt_at, lease_version)"
        " SELECT tenant, 'op-old-' || g, kind, params, fingerprint, fingerprint_key_version,"
        " idempotency_key, 'cancelled', 1, max_attempts, deadline, next_attempt_at, 1"
        " FROM operations, generate_series(1, :n) AS g WHERE op_id = 'op-template'",
        "INSERT INTO attempts (operation_id, number, lease_version, worker, started_at,"
        " finished_at, proof) SELECT id, 1, 1, 'w0', now(), now(), 'not_sent'"
        " FROM operations WHERE state = 'cancelled'",
        "INSERT INTO operation_events (operation_id, from_state, to_state, actor,"
        " lease_version, at) SELECT id, 'submitted', 'cancelled', 'reconciler:r0', 1, now()"
        " FROM operations WHERE state = 'cancelled'",
    ]
    with rig.sessions.begin() as s:
        for statement in history:
            s.execute(text(statement), {"n": settled})
    rig.executor().execute([rig.enqueue("op-sent", {**GOOD, "amount_minor": 1})])
    rig.enqueue("op-live", {**GOOD, "amount_minor": 2})
    with rig.sessions.begin() as s:
        s.execute(text("ANALYZE"))


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_no_scrape_statement_reads_a_growing_table_whole(
    rig: Rig, statements: list[tuple[str, Any]]
) -> None:
    rig.judged_by_ledger = False  # history written by hand: nothing was sent for it
    fill(rig, 5000)
    reg = registry(rig.sessions)
    scrape(reg)  # the first one reads back to where this process started
    rig.executor().execute([rig.enqueue("op-new", {**GOOD, "amount_minor": 3})])
    statements.clear()
    m = scrape(reg)
    assert m[("settled_attempts_total", (("outcome", "done"),))] == 1  # the events were read
    scrape_statements = list(statements)
    # A fixed number of statements, whatever the tables hold (8: the downstream clock lag
    # episodes are one more, a count over a table of a row per episode; and on PostgreSQL 2
    # more, the replication's settings and its standbys, a row per standby).
    assert len(scrape_statements) <= 10, [s for s, _ in scrape_statements]
    for statement, parameters in scrape_statements:
        if not statement.lstrip().upper().startswith("SELECT"):
            continue
        assert whole_table_reads(explain(rig.engine, statement, parameters)) == [], statement
    # The statements a scrape runs only when ids are missing (uncommitted or rolled back).
    with rig.sessions() as s:
        last = int(s.scalar(text("SELECT max(id) FROM operation_events")) or 0)
    for rare in (
        GAPS_BETWEEN.params(lo=last - 5, hi=last),
        TRANSITIONS_OF.params(ids=[1, 2]),
        OUTCOMES_OF.params(ids=[1, 2]),
    ):
        sql = str(rare.compile(rig.engine, compile_kwargs={"literal_binds": True}))
        assert whole_table_reads(explain(rig.engine, sql, None)) == [], sql


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_the_plan_check_catches_the_old_whole_table_aggregates(rig: Rig) -> None:
    rig.judged_by_ledger = False
    fill(rig, 5000)
    old = [
        "SELECT state, count(*) FROM operations GROUP BY state",
        "SELECT proof, count(*) FROM attempts GROUP BY proof",
        "SELECT to_state, count(*) FROM operation_events WHERE actor LIKE 'reconciler:%%'"
        " GROUP BY to_state",
    ]
    for statement in old:
        assert whole_table_reads(explain(rig.engine, statement, ())) != [], statement


def test_the_live_state_gauge_covers_every_state_that_is_not_terminal() -> None:
    assert set(LIVE) == set(State) - TERMINAL


def test_a_scrape_on_an_empty_database_reports_zeros(engine: Engine) -> None:
    m = scrape(registry(sessionmaker(engine)))
    assert m[("settled_review_queue_depth", ())] == 0
    assert m[("settled_oldest_unknown_age_seconds", ())] == 0
    assert m[("settled_operations", (("state", "unknown"),))] == 0
