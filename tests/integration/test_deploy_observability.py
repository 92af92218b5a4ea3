"""The Grafana dashboard and the Prometheus alert rules in ``deploy/`` name only metrics that
Settled exports (taken from a real scrape), and the rules are valid (``promtool`` where it is
installed: the Debian package ``prometheus`` ships it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from settled.metrics import registry

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "settled.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"

#: Series Prometheus itself records for every target it scrapes (worker liveness reads it).
PROMETHEUS_OWN = {"up"}

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset",
}  # fmt: skip


def exported(engine: Engine) -> set[str]:
    """The series names a scrape of an (empty) database exposes, and Settled's counters of the
    app's own process (``settled_hints_total``, prometheus_client's default registry);
    counters with ``_total``."""
    text = generate_latest(registry(sessionmaker(engine))).decode()
    text += generate_latest(REGISTRY).decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("settled_"):
            names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions,
    keywords, label names (matchers, ``by``/``without``/``on`` lists) or inside strings."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    stripped = re.sub(r"\{[^}]*\}", "", stripped)  # label matchers
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # ranges, subqueries
    stripped = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped
    )
    names = set()
    for match in re.finditer(r"[0-9][\w.]*|[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        name = match.group()
        following = stripped[match.end() :].lstrip()
        if name[0].isdigit() or following.startswith("(") or name in KEYWORDS:
            continue  # a number or duration, a function, a keyword
        names.add(name)
    return names


def test_metric_names_reads_names_not_labels_functions_or_keywords() -> None:
    expr = (
        'max by (state) (rate(settled_x_total{outcome=~"a|b"}[5m])) / max(settled_y) > 0.2'
        " and sum without (outcome) (settled_z) > bool 1 or on (job) up offset 5m"
    )
    assert metric_names(expr) == {"settled_x_total", "settled_y", "settled_z", "up"}


def dashboard_exprs(panels: list[dict[str, Any]]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for panel in panels:
        if panel.get("type") == "row":
            found += dashboard_exprs(panel.get("panels", []))
            continue
        targets = panel.get("targets", [])
        assert targets, f"panel {panel.get('title')!r} shows nothing"
        found += [(panel["title"], t["expr"]) for t in targets]
    return found


def test_every_dashboard_panel_reads_metrics_settled_exports(sqlite: Engine) -> None:
    names = exported(sqlite)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard["panels"])
    assert len(exprs) >= 8
    for title, expr in exprs:
        read = metric_names(expr)
        assert read, (title, expr)
        assert read <= names | PROMETHEUS_OWN, (title, read - names)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_alert_rule_parses_and_reads_metrics_settled_exports(sqlite: Engine) -> None:
    names = exported(sqlite)
    groups = YAML(typ="safe").load(ALERTS.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    alerts = {rule["alert"] for rule in rules}
    assert {
        "SettledOldestUnknownTooOld",
        "SettledReviewQueueGrowing",
        "SettledNoReconcilePass",
        "SettledSendsFailing",
        "SettledCredentialsRefused",
        "SettledFingerprintMismatch",
        "SettledWorkerDown",
        "SettledNoWorkers",
        "SettledSendQueueDeep",
    } <= alerts
    for rule in rules:
        read = metric_names(rule["expr"])
        assert read, rule["alert"]
        assert read <= names | PROMETHEUS_OWN, (rule["alert"], read - names)
        assert rule["annotations"]["summary"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        done = subprocess.run(
            ["promtool", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_rule_has_a_promtool_unit_test() -> None:
    """Each alert in alerts.yml is evaluated, firing, by at least one test in alerts_test.yml."""
    yaml = YAML(typ="safe")
    rules = [r for g in yaml.load(ALERTS.read_text())["groups"] for r in g["rules"]]
    tested = {
        case["alertname"]
        for test in yaml.load(ALERT_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in rules} - tested == set()
