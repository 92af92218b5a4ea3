"""A mistake of our own configuration that only an operation meets is loud: an app whose
fingerprint key differs from the worker's (or the development key in the app), and a tenant
API key the downstream refuses. Each is an ERROR line naming the operation (never its params),
a count in ``settled_configuration_stops_total``, and the true stop in the report; a
fingerprint mismatch is a review item too. Through the executor, against the simulator over
HTTP, on PostgreSQL and SQLite."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, select

from outbox import runs
from outbox.fingerprint import Fingerprinter
from outbox.intake import Outbox
from outbox.logs import JsonFormatter
from outbox.models import OperationEvent
from outbox.report import render
from outbox.settings import DEV_FINGERPRINT_KEY
from outbox.states import State
from settled.metrics import registry
from settled.simulator import SimulatorControl
from tests.integration.test_celery_worker import App, broker_url, stack
from tests.integration.test_metrics import scrape
from tests.support.judge import check_truthful
from tests.support.rig import GOOD, Rig
from tests.support.services import free_port
from tests.support.simtools import wait_until
from tests.support.stack import Stack
from workers.executor import Executor

#: What no log line may carry: the order, the amount, the payee.
CUSTOMER_DATA = (GOOD["order_id"], str(GOOD["amount_minor"]), GOOD["payee"])


def app_outbox(worker: Outbox, fingerprint_key: str) -> Outbox:
    """The app's Outbox: the worker's, but ``fingerprint_key`` as fingerprint key v1."""
    return replace(worker, fingerprinter=Fingerprinter({"v1": fingerprint_key.encode()}, "v1"))


def enqueue_in_run(rig: Rig, outbox: Outbox | None = None) -> tuple[int, str]:
    """One refund, in a run of its own: the operation's id and the run's handle."""
    with rig.sessions.begin() as s:
        run = runs.open_run(s, tenant="acme")
        got = (outbox or rig.outbox).enqueue(
            s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run
        )
        return got.operation.id, run.handle


def report(rig: Rig, handle: str, lang: str) -> str:
    with rig.sessions() as s:
        return render(runs.run_report(s, "acme", handle), lang)  # type: ignore[arg-type]


def status(rig: Rig) -> dict[str, object]:
    with rig.sessions() as s:
        return runs.operation_status(s, "acme", "op-1")


def stop_reason(rig: Rig, op: int) -> str | None:
    with rig.sessions() as s:
        return s.scalar(
            select(OperationEvent.reason).where(
                OperationEvent.operation_id == op, OperationEvent.to_state == "rejected"
            )
        )


def errors_naming(caplog: pytest.LogCaptureFixture, logger: str) -> list[dict[str, object]]:
    """The ERROR lines of ``logger``, as the JSON formatter writes them."""
    formatter = JsonFormatter()
    lines = [formatter.format(r) for r in caplog.records if r.name == logger]
    found = [json.loads(line) for line in lines]
    errors = [line for line in found if line["level"] == "error"]
    for line in lines:
        assert not any(data in line for data in CUSTOMER_DATA), line
    return errors


def stops(reg: object, reason: str) -> float:
    return scrape(reg)[("settled_configuration_stops_total", (("reason", reason),))]  # type: ignore[arg-type]


# -- a fingerprint that does not match ------------------------------------------------------


@pytest.mark.parametrize(
    "app_key", ["another-fingerprint-key-0002", DEV_FINGERPRINT_KEY], ids=["differs", "dev_key"]
)
def test_fingerprint_mismatch_is_an_error_line_a_review_item_a_count_and_the_true_stop(
    rig: Rig, caplog: pytest.LogCaptureFixture, app_key: str
) -> None:
    reg = registry(rig.sessions)
    op, handle = enqueue_in_run(rig, app_outbox(rig.outbox, app_key))
    caplog.set_level(logging.INFO)

    assert rig.executor().execute([op]) == {op: State.REJECTED}

    row = rig.op(op)
    assert (row.state, row.reason, row.attempts) == ("rejected", "not_executed", 0)
    assert rig.sends(op) == 0  # never sent: the row may have been altered
    (error,) = errors_naming(caplog, "workers.claiming")
    assert (error["tenant"], error["op_id"], error["stop"]) == (
        "acme",
        "op-1",
        "fingerprint_mismatch",
    )
    assert "SETTLED_FINGERPRINT_KEYS" in str(error["msg"])
    (item,) = rig.reviews(op)
    assert (item.reason, item.resolved_at, item.tenant) == ("fingerprint_mismatch", None, "acme")
    assert stop_reason(rig, op) == "fingerprint_mismatch"
    assert stops(reg, "fingerprint_mismatch") == 1
    assert stops(reg, "credentials_refused") == 0
    assert status(rig)["evidence"] == {"reason": "fingerprint_mismatch", "in_review": True}
    en, zh = report(rig, handle, "en"), report(rig, handle, "zh")
    assert "did not match their fingerprint" in en and "in time" not in en
    assert "指纹不符" in zh and "未能及时" not in zh


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_a_worker_meeting_the_development_key_in_the_app_says_so_in_its_logs_and_metrics(
    stack: Stack, pg: Engine, outbox: Outbox, sim_control: SimulatorControl
) -> None:
    """The whole path: an app fingerprinting with the development key, a real ``settled
    worker`` (production keys) over Redis: its JSON log line, its /metrics, the review item."""
    port = free_port()
    worker = stack.start_worker(SETTLED_METRICS_PORT=str(port))
    app = App(stack, pg, app_outbox(outbox, DEV_FINGERPRINT_KEY))
    try:
        (op,) = app.enqueue(1)
        wait_until(lambda: app.states([op])[op] == "rejected", 60, "the worker stops it")

        def counted() -> bool:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                return False
            return 'settled_configuration_stops_total{reason="fingerprint_mismatch"} 1.0' in text

        wait_until(counted, 30, "the worker's /metrics counts the stop")
        log = stack.log_of(worker)
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        (error,) = [e for e in lines if e.get("stop") == "fingerprint_mismatch"]
        assert (error["level"], error["tenant"], error["op_id"]) == ("error", "acme", "op-0")
        assert GOOD["order_id"] not in log and GOOD["payee"] not in log
        with app.sessions() as s:
            assert runs.operation_status(s, "acme", "op-0")["evidence"] == {
                "reason": "fingerprint_mismatch",
                "in_review": True,
            }
        check_truthful(app.sessions, sim_control)
        assert sim_control.requests("acme", app.keys([op])[0]) == 0
    finally:
        app.close()


def test_a_matching_fingerprint_is_sent_and_counts_no_stop(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    reg = registry(rig.sessions)
    op, _ = enqueue_in_run(rig, app_outbox(rig.outbox, "test-fingerprint-key-0001"))  # the worker's
    caplog.set_level(logging.INFO)
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert errors_naming(caplog, "workers.claiming") == []
    assert rig.reviews(op) == []
    assert stops(reg, "fingerprint_mismatch") == 0


# -- credentials the downstream refuses -----------------------------------------------------


def wrong_key(rig: Rig) -> Executor:
    executor = rig.executor()
    executor.gateway = rig.gateway(api_keys={"acme": SecretStr("sk_wrong")})
    return executor


def no_key(rig: Rig) -> Executor:
    executor = rig.executor()
    executor.gateway = rig.gateway(api_keys={})
    return executor


def key_not_allowed(rig: Rig) -> Executor:
    rig.control.add_rule("403")  # 403 permission_error: this key may not do this
    return rig.executor()


CAUSES = {"wrong_key_401": wrong_key, "no_key": no_key, "key_not_allowed_403": key_not_allowed}


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_refused_credentials_are_labelled_ours_logged_counted_and_reported(
    rig: Rig, caplog: pytest.LogCaptureFixture, cause: str
) -> None:
    reg = registry(rig.sessions)
    op, handle = enqueue_in_run(rig)
    executor = CAUSES[cause](rig)
    caplog.set_level(logging.INFO)

    assert executor.execute([op]) == {op: State.REJECTED}

    row = rig.op(op)
    assert (row.state, row.reason) == ("rejected", "permission_denied")
    assert rig.effects(op) == 0
    assert stop_reason(rig, op) == "credentials_refused"  # not a business refusal
    (error,) = errors_naming(caplog, "workers.executor")
    assert (error["tenant"], error["op_id"], error["stop"]) == (
        "acme",
        "op-1",
        "credentials_refused",
    )
    assert stops(reg, "credentials_refused") == 1
    assert stops(reg, "fingerprint_mismatch") == 0
    assert status(rig)["evidence"]["reason"] == "credentials_refused"  # type: ignore[index]
    assert "refused our credentials" in report(rig, handle, "en")
    assert "拒绝了我方凭据" in report(rig, handle, "zh")
    # Rejected, never retried (docs/observability.md, "Alerts"): no review item, nothing claims
    # it again.
    assert rig.reviews(op) == []
    rig.make_due(op)
    assert executor.execute([op]) == {}


def test_stripe_authentication_error_is_labelled_ours(
    stripe_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig = stripe_rig
    reg = registry(rig.sessions)
    op, handle = enqueue_in_run(rig)
    caplog.set_level(logging.INFO)
    assert wrong_key(rig).execute([op]) == {op: State.REJECTED}
    assert (rig.op(op).reason, stop_reason(rig, op)) == ("permission_denied", "credentials_refused")
    (error,) = errors_naming(caplog, "workers.executor")
    assert (error["tenant"], error["op_id"], error["status"]) == ("acme", "op-1", 401)
    assert stops(reg, "credentials_refused") == 1
    assert "refused our credentials" in report(rig, handle, "en")


def test_a_business_refusal_is_not_counted_as_ours(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    reg = registry(rig.sessions)
    op = rig.enqueue(params={**GOOD, "amount_minor": 999999})  # beyond the charged amount
    caplog.set_level(logging.INFO)
    rig.executor().execute([op])
    assert (rig.op(op).reason, stop_reason(rig, op)) == ("business_rejected", "business_rejected")
    assert errors_naming(caplog, "workers.executor") == []
    assert stops(reg, "credentials_refused") == 0


# -- the send queue's depth -----------------------------------------------------------------


def test_send_queue_depth_counts_due_planned_operations_only(rig: Rig) -> None:
    reg = registry(rig.sessions)
    due = rig.enqueue("op-due")
    later = rig.enqueue("op-later", {**GOOD, "amount_minor": 5})
    rig.make_due(due)
    rig.set(later, next_attempt_at=datetime.now(UTC) + timedelta(hours=1))
    m = scrape(reg)
    assert m[("settled_send_queue_depth", ())] == 1
    assert m[("settled_operations", (("state", "planned"),))] == 2
    rig.executor().execute([due])
    assert scrape(reg)[("settled_send_queue_depth", ())] == 0


_FIXTURES = (broker_url, stack)  # the real worker's, from tests.integration.test_celery_worker
