"""The fault soak's judgement (``bench/soak.py``): the database against the simulator's
ledger, the report and its table."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

import psycopg

from bench.soak_plan import DOWNSTREAM_KINDS, KILLS
from bench.soak_procs import LEASE_SECONDS, TERMINAL, libpq
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
            " (SELECT count(*) FROM attempts a WHERE a.operation_id = o.id)"
            " FROM operations o ORDER BY o.id"
        ).fetchall()
        business = {(t, o) for t, o in conn.execute("SELECT tenant, op_id FROM soak_requests")}
        recovery_rows = _recoveries(conn, soak.recoveries)

    results: list[dict[str, Any]] = []
    for i in range(soak.args.producers):
        path = soak.out / f"producer-{i}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "no result"})
    committed = {(t, o) for r in results for t, o, _ in r.get("committed", [])}

    keys = {(row[1], row[4]) for row in ops}
    by_op = {(row[1], row[2]): row for row in ops}
    problems: dict[str, list[int]] = {"duplicates": [], "lost": [], "lies": [], "sends": []}
    states: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    in_review = 0
    max_rows = max_requests = 0
    over_rows = over_requests = 0
    for op, tenant, _op_id, kind, key, state, reason, budget, source, review, rows in ops:
        n = effects.get((tenant, key), 0)
        kinds[kind] += 1
        states[f"{state}/{reason}" if reason else state] += 1
        in_review += bool(review)
        if n > 1:
            problems["duplicates"].append(op)
        if state not in TERMINAL and not review:
            problems["lost"].append(op)
        if (state in ("rejected", "cancelled") and n > 0) or (
            state == "succeeded" and source != "staff" and n == 0
        ):
            problems["lies"].append(op)
        sent = submits.get((tenant, key), 0)
        max_rows, max_requests = max(max_rows, rows), max(max_requests, sent)
        over_rows += rows > budget
        over_requests += sent > budget
        if rows > budget or sent > budget:
            problems["sends"].append(op)
    missing = sorted((committed | business) - set(by_op))
    phantom = sorted(k for k in effects if k not in keys)

    kills = Counter(e["kind"] for e in soak.timeline.events if e["kind"] in KILLS)
    restarts = Counter(e["target"] for e in soak.timeline.events if e["kind"] == "restart")
    exits = sum(e["kind"] == "exited" for e in soak.timeline.events)
    skipped = Counter(e["fault"] for e in soak.timeline.events if e["kind"] == "skipped")
    whole = [r for r in recovery_rows if r["kind"] in ("kill_worker_group", "stop_worker")]
    slowest = max(whole, key=lambda r: r["seconds"] or 0.0, default=None)
    takeover = max(whole, key=lambda r: r["takeover_seconds"] or 0.0, default=None)
    child = [r for r in recovery_rows if r["kind"] == "kill_worker_child"]
    slowest_child = max(child, key=lambda r: r["seconds"] or 0.0, default=None)
    firsts = [r["first_commit"] for r in results if r.get("first_commit")]
    elapsed = settled_at - min(firsts) if firsts else 0.0
    throughput = len(ops) / elapsed if elapsed > 0 else 0.0
    producer_errors = [r["error"] for r in results if r.get("error")]
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r.get("counts", {}))

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
    report: dict[str, Any] = {
        "seed": soak.seed,
        "ops_requested": soak.args.ops,
        "duration": soak.args.duration,
        "lease_seconds": LEASE_SECONDS,
        "downstream_timeout": soak.args.downstream_timeout,
        "operations": len(ops),
        "committed_by_producers": len(committed),
        "operations_by_kind": dict(sorted(kinds.items())),
        "states": dict(sorted(states.items())),
        "in_review": in_review,
        "transactions": dict(sorted(counts.items())),
        "downstream_faults": {k: injected.get(k, 0) for k in DOWNSTREAM_KINDS}
        | {k: v for k, v in injected.items() if k not in DOWNSTREAM_KINDS},
        "lookup_outages": sum(e["kind"] == "lookup_outage_begin" for e in soak.timeline.events),
        "kills": {k: kills.get(k, 0) for k in KILLS},
        "skipped": dict(skipped),
        "restarts": dict(sorted(restarts.items())),
        "unexpected_exits": exits,
        "duplicates": len(problems["duplicates"]),
        "lost": len(problems["lost"]) + len(missing),
        "lies": len(problems["lies"]),
        "phantom_effects": len(phantom),
        "sends": {
            "max_attempt_rows": max_rows,
            "attempt_rows_above_max_attempts": over_rows,
            "max_submits_seen_by_simulator": max_requests,
            "submits_above_max_attempts": over_requests,
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
    return report


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


def render(r: dict[str, Any]) -> str:
    def kv(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"

    sends = r["sends"]
    slow = r["slowest_recovery"]
    slow_text = (
        f"{slow['seconds']} s ({slow['kind']} {slow['target']} at t={slow['t']} s, "
        f"{slow['held']} ops held)"
        if slow and slow["seconds"] is not None
        else "n/a (no worker held a lease when killed or stopped)"
    )
    child = r["slowest_child_recovery"]
    take = r["slowest_takeover"]
    rows = [
        ("seed", str(r["seed"])),
        ("operations", f"{r['operations']} ({kv(r['operations_by_kind'])})"),
        ("  transactions", kv(r["transactions"])),
        ("  final states", f"{kv(r['states'])}; in review {r['in_review']}"),
        ("downstream faults injected", kv(r["downstream_faults"])),
        ("  lookup outage windows", str(r["lookup_outages"])),
        ("kills and stops", kv(r["kills"])),
        ("  restarts by the supervisor", kv(r["restarts"])),
        ("duplicates (effects > 1 per key)", str(r["duplicates"])),
        ("lost (neither terminal nor in review)", str(r["lost"])),
        ("lies (state the ledger contradicts)", str(r["lies"])),
        (
            "sends per operation (attempt rows)",
            f"max {sends['max_attempt_rows']}; above max_attempts "
            f"{sends['attempt_rows_above_max_attempts']}",
        ),
        (
            "sends per operation (simulator)",
            f"max {sends['max_submits_seen_by_simulator']}; above max_attempts "
            f"{sends['submits_above_max_attempts']}",
        ),
        ("slowest recovery (worker killed/stopped)", slow_text),
        (
            "  slowest first event after a kill/stop",
            f"{take['takeover_seconds']} s ({take['kind']} {take['target']} at t={take['t']} s)"
            if take and take["takeover_seconds"] is not None
            else "n/a",
        ),
        (
            "  slowest after a child kill",
            f"{child['seconds']} s" if child and child["seconds"] is not None else "n/a",
        ),
        (
            "last fault to all settled",
            f"{r['seconds_from_last_fault_to_settled']} s"
            if r["settled"]
            else "NOT settled in time",
        ),
        ("throughput", f"{r['throughput_ops_per_second']} ops/s (first intake to all settled)"),
        ("verdict", "PASS" if r["passed"] else "FAIL: " + "; ".join(r["failures"])),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'figure':<{width}}  value", f"{'-' * width}  {'-' * 50}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
