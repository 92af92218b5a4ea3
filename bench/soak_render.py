"""The fault soak's table (``bench/soak.py``): the report's figures, one a line."""

from __future__ import annotations

from typing import Any


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
