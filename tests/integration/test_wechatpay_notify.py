"""WeChat Pay's refund-result notification end to end: the simulator's WeChat Pay mode posts it
(``/_control/wechatpay/notify``) to the status API that ``settled web`` builds from the
settings (``POST /notify/wechatpay/{tenant}``), over HTTP. A verified notification settles an
unknown operation as a lookup would, with evidence ``notification``; a repeat writes nothing;
one that proves nothing (tampered, too old, another tenant's or merchant's, not decryptable with
the tenant's APIv3 key) is refused with nothing written. The judge is the database's event rows
and the simulator's ledger."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import func, select

from outbox.downstream import DownstreamRequest
from outbox.kinds import default_registry
from outbox.models import OperationEvent
from outbox.settings import Settings
from settled.simulator.wechatpay import PREFIX as WECHATPAY_PREFIX
from settled.web import create_web_app
from settled.wechatpay_notify import MAX_BODY
from tests.integration.test_web import serving
from tests.integration.test_wechatpay_mode import _processing
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.wechatpay import control

pytestmark = pytest.mark.parametrize("engine", ["postgresql"], indirect=True)


@dataclass
class Notify:
    rig: Rig
    client: httpx.Client

    def url(self, tenant: str = "acme") -> str:
        return f"{self.client.base_url}/notify/wechatpay/{tenant}"

    def send(self, op: int, tenant: str = "acme", **extra: Any) -> dict[str, Any]:
        """The simulator notifies ``tenant``'s ``notify_url`` of ``op``'s refund."""
        key = self.rig.op(op).idempotency_key
        return self.rig.control.notify_wechatpay("acme", key, self.url(tenant), **extra)

    def genuine(self, op: int) -> tuple[dict[str, str], bytes]:
        """A genuine notification of ``op``'s refund, delivered nowhere it is taken."""
        answer = self.send(op, tenant="nobody")
        assert answer["answer"]["status"] == 404  # no merchant takes it there: nothing written
        sent = answer["sent"]
        return dict(sent["headers"]), sent["body"].encode()

    def post(self, headers: dict[str, str], body: bytes, tenant: str = "acme") -> httpx.Response:
        return self.client.post(f"/notify/wechatpay/{tenant}", headers=headers, content=body)

    def events(self, op: int) -> int:
        with self.rig.sessions() as s:
            count = select(func.count()).where(OperationEvent.operation_id == op)
            return int(s.scalar(count) or 0)

    def last_event(self, op: int) -> OperationEvent:
        with self.rig.sessions() as s:
            stmt = (
                select(OperationEvent)
                .where(OperationEvent.operation_id == op)
                .order_by(OperationEvent.id.desc())
            )
            event = s.scalars(stmt).first()
            assert event is not None
            return event


@pytest.fixture
def notify(wechatpay_rig: Rig) -> Iterator[Notify]:
    """The status API built from WeChat Pay settings, served on a port: ``acme``'s merchant;
    ``globex`` configured with the very same merchant (its operations are not acme's);
    ``initech`` with another merchant number; ``umbrella`` with another APIv3 key."""
    rig = wechatpay_rig
    assert rig.wechatpay is not None
    merchant = rig.wechatpay
    settings = Settings(
        database_url=rig.engine.url.render_as_string(hide_password=False),
        development=True,
        downstream_url=rig.url,
        downstream_api_keys={"acme": rig.tenant.api_key.get_secret_value()},
        downstream_providers={"refund": "wechatpay"},
        wechatpay_merchants={
            "acme": merchant,
            "globex": merchant,
            "initech": merchant.model_copy(update={"mchid": "1900000110"}),
            "umbrella": merchant.model_copy(
                update={"api_v3_key": SecretStr("umbrellas-own-apiv3-key-01234567")}
            ),
        },
        wechatpay_api_base=rig.url + WECHATPAY_PREFIX,
        wechatpay_order_totals="tests.support.wechatpay:order_total",
    )
    with serving(create_web_app(settings)) as client:
        yield Notify(rig, client)


def _unknown(rig: Rig) -> int:
    """An operation refunded at WeChat Pay whose answer was lost: unknown, one effect."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown" and rig.effects(op) == 1
    return op


def test_a_notification_settles_a_lost_answer_with_evidence_notification(notify: Notify) -> None:
    rig = notify.rig
    op = _unknown(rig)
    answer = notify.send(op)
    assert answer["answer"] == {"status": 204, "body": ""}
    row = rig.op(op)
    assert row.state == "succeeded" and row.lookups == 0  # no query asked: the notice proved it
    event = notify.last_event(op)
    assert event.actor == "wechatpay:notification"
    assert event.evidence is not None and event.evidence["evidence"] == "notification"
    assert event.evidence["event_type"] == "REFUND.SUCCESS"
    resource = json.loads(answer["sent"]["body"])["resource"]
    assert resource["ciphertext"] not in json.dumps(event.evidence)
    assert row.receipt is not None and row.receipt["reference"] == event.evidence["reference"]
    assert rig.effects(op) == 1 and rig.sends(op) == 1
    assert rig.reconciler().run_once().claimed == 0  # nothing left to reconcile


def test_a_repeated_notification_writes_nothing(notify: Notify) -> None:
    rig = notify.rig
    op = _unknown(rig)
    first = notify.send(op)
    assert first["answer"]["status"] == 204
    events = notify.events(op)
    again = notify.post(dict(first["sent"]["headers"]), first["sent"]["body"].encode())
    assert again.status_code == 204 and again.content == b""
    assert notify.send(op)["answer"]["status"] == 204  # a fresh one of the same refund
    assert notify.events(op) == events and rig.op(op).state == "succeeded"


@pytest.mark.parametrize(
    ("status", "state", "code"),
    [
        ("SUCCESS", "succeeded", None),
        ("CLOSED", "rejected", "refund_closed"),
        ("ABNORMAL", "rejected", "refund_abnormal"),
    ],
)
def test_a_processing_refund_is_settled_by_its_notification(
    notify: Notify, status: str, state: str, code: str | None
) -> None:
    rig = notify.rig
    op, row = _processing(rig)
    control(rig.url, "settle", {"tenant": "acme", "key": row.idempotency_key, "status": status})
    assert notify.send(op)["answer"]["status"] == 204
    settled = rig.op(op)
    assert (settled.state, settled.reason) == (state, None if code is None else "business_rejected")
    event = notify.last_event(op)
    assert event.evidence is not None and event.evidence.get("code") == code
    assert rig.effects(op) == (1 if status == "SUCCESS" else 0) and rig.sends(op) == 1


def _flip_signature(headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
    raw = bytearray(base64.b64decode(headers["Wechatpay-Signature"]))
    raw[11] ^= 1
    return {**headers, "Wechatpay-Signature": base64.b64encode(bytes(raw)).decode()}, body


def _flip_ciphertext(headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
    data = json.loads(body)
    sealed = bytearray(base64.b64decode(data["resource"]["ciphertext"]))
    sealed[3] ^= 1
    data["resource"]["ciphertext"] = base64.b64encode(bytes(sealed)).decode()
    return headers, json.dumps(data, ensure_ascii=False).encode()


@pytest.mark.parametrize(
    ("tamper", "status"), [(_flip_signature, 401), (_flip_ciphertext, 401)], ids=["sig", "cipher"]
)
def test_a_tampered_notification_is_refused_and_nothing_written(
    notify: Notify, tamper: Any, status: int
) -> None:
    rig = notify.rig
    op = _unknown(rig)
    events = notify.events(op)
    answer = notify.post(*tamper(*notify.genuine(op)))
    assert answer.status_code == status
    assert answer.json()["code"] == "FAIL"
    assert rig.op(op).state == "unknown" and notify.events(op) == events
    assert rig.reviews(op) == []


def test_an_old_notification_replayed_is_refused_and_nothing_written(notify: Notify) -> None:
    rig = notify.rig
    op = _unknown(rig)
    events = notify.events(op)
    answer = notify.send(op, timestamp=int(time.time()) - 600)
    assert answer["answer"]["status"] == 401
    assert json.loads(answer["answer"]["body"])["code"] == "FAIL"
    assert rig.op(op).state == "unknown" and notify.events(op) == events


@pytest.mark.parametrize(
    ("tenant", "status", "why"),
    [
        ("globex", 404, "no refund of this tenant"),  # the same merchant, not its operation
        ("initech", 400, "another merchant"),
        ("umbrella", 400, "APIv3 key"),
        ("nobody", 404, "no WeChat Pay merchant"),
    ],
)
def test_a_notification_to_another_tenant_is_refused_and_nothing_written(
    notify: Notify, tenant: str, status: int, why: str
) -> None:
    rig = notify.rig
    op = _unknown(rig)
    events = notify.events(op)
    answer = notify.post(*notify.genuine(op), tenant=tenant)
    assert answer.status_code == status
    assert answer.json()["code"] == "FAIL" and why in answer.json()["message"]
    assert rig.op(op).state == "unknown" and notify.events(op) == events
    assert rig.reviews(op) == []


def test_a_notified_refund_that_does_not_match_the_intent_goes_to_review(notify: Notify) -> None:
    """WeChat Pay's refund is of another amount than the operation's intent: it settles nothing
    and the operation goes to review as a mismatch, once, however often it is notified."""
    rig = notify.rig
    op = _unknown(rig)
    rig.set(op, params={**GOOD, "amount_minor": 5000})
    assert notify.send(op)["answer"]["status"] == 204  # taken: WeChat Pay need not repeat it
    assert rig.op(op).state == "unknown"
    assert [r.reason for r in rig.reviews(op)] == ["lookup_mismatch"]
    event = notify.last_event(op)
    assert event.evidence is not None and event.evidence["code"] == "receipt_mismatch"
    events = notify.events(op)
    assert notify.send(op)["answer"]["status"] == 204
    assert notify.events(op) == events and len(rig.reviews(op)) == 1


def test_no_notification_body_or_key_reaches_the_log(
    notify: Notify, caplog: pytest.LogCaptureFixture
) -> None:
    rig = notify.rig
    op = _unknown(rig)
    caplog.set_level("DEBUG")
    headers, body = notify.genuine(op)
    notify.post(*_flip_signature(headers, body))
    notify.post(headers, body, tenant="umbrella")
    assert notify.post(headers, body).status_code == 204
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "wechatpay notification refused" in text and "wechatpay notification taken" in text
    assert rig.wechatpay is not None and rig.wechatpay.api_v3_key is not None
    ciphertext = json.loads(body)["resource"]["ciphertext"]
    for secret in (rig.wechatpay.api_v3_key.get_secret_value(), ciphertext[:40], "A1042"):
        assert secret not in text, secret


def test_a_notification_while_the_send_is_in_flight_waits_for_the_executor(
    notify: Notify,
) -> None:
    """The worker has sent and not yet written what came back (``submitted``): the
    notification settles nothing now (503: WeChat Pay notifies again later) and writes
    nothing; the executor's own outcome is not raced."""
    rig = notify.rig
    op = rig.enqueue()
    rig.start_send(op)
    row = rig.op(op)
    request = DownstreamRequest(
        "acme", row.op_id, default_registry().get("refund"), row.idempotency_key, row.params
    )
    rig.gateway().submit(request, deadline=datetime.now(UTC) + timedelta(seconds=5))
    events = notify.events(op)
    answer = notify.send(op)["answer"]
    assert answer["status"] == 503 and json.loads(answer["body"])["code"] == "FAIL"
    assert rig.op(op).state == "submitted" and notify.events(op) == events


def test_a_body_past_the_limit_is_refused_unread(notify: Notify) -> None:
    rig = notify.rig
    op = _unknown(rig)
    headers, body = notify.genuine(op)
    events = notify.events(op)
    answer = notify.post(headers, body + b" " * (MAX_BODY + 1))
    assert answer.status_code == 413 and answer.json()["code"] == "FAIL"
    assert rig.op(op).state == "unknown" and notify.events(op) == events


def test_a_notification_contradicting_a_settled_operation_changes_nothing_and_says_so(
    notify: Notify,
) -> None:
    """WeChat Pay notifies CLOSED for an operation Settled holds as succeeded (rewritten here
    by hand from the rejected it was settled as: no path of Settled's writes that): it stays
    as it is, and one event ``notification_contradicts`` tells support what WeChat Pay said."""
    rig = notify.rig
    op, row = _processing(rig)
    control(rig.url, "settle", {"tenant": "acme", "key": row.idempotency_key, "status": "CLOSED"})
    assert rig.reconciler().run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "rejected"
    rig.set(op, state="succeeded", reason=None)
    events = notify.events(op)
    assert notify.send(op)["answer"]["status"] == 204
    assert rig.op(op).state == "succeeded" and notify.events(op) == events + 1
    event = notify.last_event(op)
    assert (event.reason, event.from_state, event.to_state) == (
        "notification_contradicts",
        "succeeded",
        "succeeded",
    )
    assert event.evidence is not None
    assert (event.evidence["status"], event.evidence["state"]) == ("CLOSED", "succeeded")
    rig.set(
        op, state="rejected", reason="business_rejected"
    )  # as it was: the ledger's judge checks every row at the end
