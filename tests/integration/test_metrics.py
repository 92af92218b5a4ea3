"""Prometheus metrics read from the database: every figure follows the rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.rig import GOOD, HOLD, Rig
from workers.metrics import registry


def scrape(rig: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry(rig.sessions)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_follow_states_attempts_reviews_and_reconcile_results(rig: Rig) -> None:
    ok = rig.enqueue("op-ok")
    lost = rig.enqueue("op-lost", {**GOOD, "amount_minor": 5})
    rig.enqueue("op-waiting", {**GOOD, "amount_minor": 6})
    rig.executor().execute([ok])
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD, times=1)
    rig.control.add_rule("lookup_unavailable")
    rig.executor().execute([lost])
    rig.set(lost, unknown_since=datetime.now(UTC) - timedelta(seconds=900))
    rig.reconciler().run_once()

    m = scrape(rig)
    assert m[("settled_operations", (("state", "succeeded"),))] == 1
    assert m[("settled_operations", (("state", "unknown"),))] == 1
    assert m[("settled_operations", (("state", "planned"),))] == 1
    assert m[("settled_operations", (("state", "rejected"),))] == 0
    assert m[("settled_attempts_total", (("outcome", "done"),))] == 1
    assert m[("settled_attempts_total", (("outcome", "unknown"),))] == 1
    assert m[("settled_review_queue_depth", ())] == 1
    assert 890 < m[("settled_oldest_unknown_age_seconds", ())] < 1200
    assert m[("settled_reconcile_results_total", (("result", "to_review"),))] == 1
