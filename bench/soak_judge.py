"""The fault soak's judgement (``bench/soak.py``): the database against the simulator's
ledger, the report and its table."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from bench.soak_plan import DOWNSTREAM_KINDS, KILLS
from bench.soak_procs import LEASE_SECONDS, TERMINAL, libpq
from bench.soak_render import render
from bench.soak_services import Recovery

if TYPE_CHECKING:
    from bench.soak_run import Soak


def judge(soak: Soak, *, last_fault: float, settled: bool, settled_at: float) -> dict[str, Any]:
    """Compare the database with the simulator's ledger; print the table; write report.json."""
    assert soak.control is not None
    ledger = soak.control.ledger()
    injected = soak.control.injected()
    effects: Counter[tuple[str, str]] = Counter(
        (e["tenant"], e["idempotency_key"]) for e in ledger["effects"]
    )
    submits = {
        (r["tenant"], r["idempotency_key"]): int(r["count"])
        for r in ledger["requests"]
        if r["phase"] == "submit"
    }
    with psycopg.connect(libpq(soak.database_url)) as conn:
        ops = conn.execute(
            "SELECT o.id, o.tenant, o.op_id, o.kind, o.idempotency_key, o.state, o.reason,"
            " o.max_attempts, o.receipt->>'source',"
            " EXISTS (SELECT 1 FROM review_items r WHERE r.operation_id = o.id"
            "         AND r.resolved_at IS NULL),"
            # the attempts max_attempts counts: those not proven unsent
            " (SELECT count(*) FROM attempts a WHERE a.operation_id = o.id"
            "  AND (a.proof IS NULL OR a.proof <> 'not_sent'))"
            " FROM operations o ORDER BY o.id"
        ).fetchall()
        business = {(t, o) for t, o in conn.execute("SELECT tenant, op_id FROM soak_requests")}
        recovery_rows = _recoveries(conn, soak.recoveries)

    results = _producer_results(soak)
    committed = {(t, o) for r in results for t, o, _ in r.get("committed", [])}

    keys = {(row[1], row[4]) for row in ops}
    by_op = {(row[1], row[2]): row for row in ops}
    tally = _tally(ops, effects, submits)
    missing = sorted((committed | business) - set(by_op))
    phantom = sorted(k for k in effects if k not in keys)
    failures = _failures(soak, tally.problems, missing, phantom, settled, results)
    report = _report(
        soak,
        operations=len(ops),
        committed=len(committed),
        tally=tally,
        injected=injected,
        recovery_rows=recovery_rows,
        results=results,
        lost=len(tally.problems["lost"]) + len(missing),
        phantom=len(phantom),
        settled=settled,
        settled_at=settled_at,
        last_fault=last_fault,
        failures=failures,
    )
    _publish(soak, report, tally.problems, missing, phantom)
    return report


def _producer_results(soak: Soak) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for i in range(soak.args.producers):
        path = soak.out / f"producer-{i}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "no result"})
    return results


@dataclass
class Tally:
    """Per operation against the ledger: the offending ones by problem, states, kinds, sends."""

    problems: dict[str, list[int]]
    states: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    in_review: int = 0
    max_rows: int = 0
    max_requests: int = 0
    over_rows: int = 0
    over_requests: int = 0


def _tally(
    ops: list[Any], effects: Counter[tuple[str, str]], submits: dict[tuple[str, str], int]
) -> Tally:
    t = Tally({"duplicates": [], "lost": [], "lies": [], "sends": []})
    problems = t.problems
    for op, tenant, _op_id, kind, key, state, reason, budget, source, review, rows in ops:
        n = effects.get((tenant, key), 0)
        t.kinds[kind] += 1
        t.states[f"{state}/{reason}" if reason else state] += 1
        t.in_review += bool(review)
        if n > 1:
            problems["duplicates"].append(op)
        if state not in TERMINAL and not review:
            problems["lost"].append(op)
        if (state in ("rejected", "cancelled") and n > 0) or (
            state == "succeeded" and source != "staff" and n == 0
        ):
            problems["lies"].append(op)
        sent = submits.get((tenant, key), 0)
        t.max_rows, t.max_requests = max(t.max_rows, rows), max(t.max_requests, sent)
        t.over_rows += rows > budget
        t.over_requests += sent > budget
        if rows > budget or sent > budget:
            problems["sends"].append(op)
    return t


def _failures(
    soak: Soak,
    problems: dict[str, list[int]],
    missing: list[tuple[str, str]],
    phantom: list[tuple[str, str]],
    settled: bool,
    results: list[dict[str, Any]],
) -> list[str]:
    producer_errors = [r["error"] for r in results if r.get("error")]
    failures = []
    for name in ("duplicates", "lost", "lies"):
        if problems[name]:
            failures.append(f"{len(problems[name])} {name}")
    if missing:
        failures.append(f"{len(missing)} committed intents missing from the database")
    if phantom:
        failures.append(f"{len(phantom)} effects for keys no operation has")
    if not settled:
        failures.append(f"unsettled {soak.args.settle_timeout:g} s after the last fault")
    if producer_errors:
        failures.append(f"producer failed: {producer_errors[0]}")
    return failures


def _slowest(
    recovery_rows: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """The slowest recovery and takeover after a worker group kill or stop, and the slowest
    recovery after a child kill."""
    whole = [r for r in recovery_rows if r["kind"] in ("kill_worker_group", "stop_worker")]
    slowest = max(whole, key=lambda r: r["seconds"] or 0.0, default=None)
    takeover = max(whole, key=lambda r: r["takeover_seconds"] or 0.0, default=None)
    child = [r for r in recovery_rows if r["kind"] == "kill_worker_child"]
    slowest_child = max(child, key=lambda r: r["seconds"] or 0.0, default=None)
    return slowest, takeover, slowest_child


def _report(
    soak: Soak,
    *,
    operations: int,
    committed: int,
    tally: Tally,
    injected: dict[str, Any],
    recovery_rows: list[dict[str, Any]],
    results: list[dict[str, Any]],
    lost: int,
    phantom: int,
    settled: bool,
    settled_at: float,
    last_fault: float,
    failures: list[str],
) -> dict[str, Any]:
    events = soak.timeline.events
    kills = Counter(e["kind"] for e in events if e["kind"] in KILLS)
    restarts = Counter(e["target"] for e in events if e["kind"] == "restart")
    exits = sum(e["kind"] == "exited" for e in events)
    skipped = Counter(e["fault"] for e in events if e["kind"] == "skipped")
    slowest, takeover, slowest_child = _slowest(recovery_rows)
    firsts = [r["first_commit"] for r in results if r.get("first_commit")]
    elapsed = settled_at - min(firsts) if firsts else 0.0
    throughput = operations / elapsed if elapsed > 0 else 0.0
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r.get("counts", {}))
    return {
        "seed": soak.seed,
        "ops_requested": soak.args.ops,
        "duration": soak.args.duration,
        "lease_seconds": LEASE_SECONDS,
        "downstream_timeout": soak.args.downstream_timeout,
        "operations": operations,
        "committed_by_producers": committed,
        "operations_by_kind": dict(sorted(tally.kinds.items())),
        "states": dict(sorted(tally.states.items())),
        "in_review": tally.in_review,
        "transactions": dict(sorted(counts.items())),
        "downstream_faults": {k: injected.get(k, 0) for k in DOWNSTREAM_KINDS}
        | {k: v for k, v in injected.items() if k not in DOWNSTREAM_KINDS},
        "lookup_outages": sum(e["kind"] == "lookup_outage_begin" for e in events),
        "kills": {k: kills.get(k, 0) for k in KILLS},
        "skipped": dict(skipped),
        "restarts": dict(sorted(restarts.items())),
        "unexpected_exits": exits,
        "duplicates": len(tally.problems["duplicates"]),
        "lost": lost,
        "lies": len(tally.problems["lies"]),
        "phantom_effects": phantom,
        "sends": {
            "max_attempt_rows": tally.max_rows,
            "attempt_rows_above_max_attempts": tally.over_rows,
            "max_submits_seen_by_simulator": tally.max_requests,
            "submits_above_max_attempts": tally.over_requests,
        },
        "slowest_recovery": slowest,
        "slowest_child_recovery": slowest_child,
        "slowest_takeover": takeover,
        "recoveries": recovery_rows,
        "settled": settled,
        "seconds_from_last_fault_to_settled": round(settled_at - last_fault, 1)
        if settled
        else None,
        "throughput_ops_per_second": round(throughput, 1),
        "failures": failures,
        "passed": not failures,
    }


def _publish(
    soak: Soak,
    report: dict[str, Any],
    problems: dict[str, list[int]],
    missing: list[tuple[str, str]],
    phantom: list[tuple[str, str]],
) -> None:
    """Print the table; write report.json (and problems.json if anything is wrong)."""
    table = render(report)
    report["table"] = table
    print()
    print(table)
    (soak.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    if any(problems.values()) or missing or phantom:
        detail = _problem_detail(soak, problems, missing, phantom)
        (soak.out / "problems.json").write_text(json.dumps(detail, indent=1, default=str))
        print(f"details of the offending operations: {soak.out / 'problems.json'}")
    print(f"timeline: {soak.out / 'timeline.jsonl'}; report: {soak.out / 'report.json'}")


def _recoveries(conn: psycopg.Connection[Any], recoveries: list[Recovery]) -> list[dict[str, Any]]:
    """Per worker kill or stop: from the moment (database time) until each operation the
    worker held reached a terminal state or the review queue; the slowest of them. Also the
    slowest takeover: until the first event any process wrote for the operation after the
    moment (what the lease decides; later downstream faults add to the first figure only)."""
    out = []
    for rec in recoveries:
        rows = conn.execute(
            "SELECT o.id, least("
            " (SELECT min(e.at) FROM operation_events e WHERE e.operation_id = o.id"
            "  AND e.to_state IN ('succeeded', 'rejected', 'cancelled')),"
            " (SELECT min(r.created_at) FROM review_items r WHERE r.operation_id = o.id)),"
            " (SELECT min(e.at) FROM operation_events e WHERE e.operation_id = o.id"
            "  AND e.at > %s)"
            " FROM operations o WHERE o.id = ANY(%s)",
            (rec.db_time, rec.held),
        ).fetchall()
        times = [(op, (at - rec.db_time).total_seconds() if at else None) for op, at, _ in rows]
        takeovers = [(at - rec.db_time).total_seconds() for _, _, at in rows if at is not None]
        done = [(max(0.0, s), op) for op, s in times if s is not None]
        seconds, slowest = max(done) if done else (None, None)
        path = []
        if slowest is not None:  # how the slowest one got there: for post-mortems
            path = [
                [round((at - rec.db_time).total_seconds(), 1), frm, to, actor, reason]
                for frm, to, actor, reason, at in conn.execute(
                    "SELECT from_state, to_state, actor, reason, at FROM operation_events"
                    " WHERE operation_id = %s ORDER BY id",
                    (slowest,),
                )
            ]
        out.append(
            {
                "t": rec.event["t"],
                "kind": rec.event["kind"],
                "target": rec.event["target"],
                "held": len(rec.held),
                "unsettled": sum(s is None for _, s in times),
                "seconds": round(seconds, 1) if seconds is not None else None,
                "takeover_seconds": round(max(takeovers), 1) if takeovers else None,
                "slowest_op": slowest,
                "slowest_path": path,
            }
        )
    return out


def _problem_detail(
    soak: Soak,
    problems: dict[str, list[int]],
    missing: list[tuple[str, str]],
    phantom: list[tuple[str, str]],
) -> dict[str, Any]:
    ids = sorted({i for v in problems.values() for i in v})[:50]
    detail: dict[str, Any] = {
        "problems": problems,
        "missing": missing,
        "phantom": [list(k) for k in phantom],
        "operations": {},
    }
    with psycopg.connect(libpq(soak.database_url)) as conn:
        for op in ids:
            row = conn.execute(
                "SELECT tenant, op_id, kind, state, reason, attempts, max_attempts, lease_owner,"
                " lease_version, idempotency_key FROM operations WHERE id = %s",
                (op,),
            ).fetchone()
            events = conn.execute(
                "SELECT id, from_state, to_state, actor, lease_version, reason, evidence, at"
                " FROM operation_events WHERE operation_id = %s ORDER BY id",
                (op,),
            ).fetchall()
            attempts = conn.execute(
                "SELECT number, lease_version, worker, started_at, not_after, finished_at, proof,"
                " status_code FROM attempts WHERE operation_id = %s ORDER BY number",
                (op,),
            ).fetchall()
            detail["operations"][op] = {"row": row, "events": events, "attempts": attempts}
    return detail
