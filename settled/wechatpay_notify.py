"""WeChat Pay's refund-result notifications (``notify_url``), taken by the status API at
``POST /notify/wechatpay/{tenant}`` (docs/providers.md, "Pointing Settled at WeChat Pay").

A notification is evidence only once ``workers.wechatpay_notify`` has verified its signature
with the tenant's platform key (fresh: five minutes), decrypted its resource with the tenant's
APIv3 key and found it the tenant's merchant's. It is then read exactly as a query's answer by
``out_refund_no`` (the stored idempotency key, looked up in the tenant's operations only) and
written the way a lookup's result is:

- an ``unknown`` operation is settled by the refund it announces (``SUCCESS`` succeeded;
  ``CLOSED`` and ``ABNORMAL`` rejected with WeChat Pay's code), its evidence ``notification``;
  a refund that does not match the intent (another amount, another order) settles nothing and
  puts the operation in review as a mismatch, as a lookup's would;
- an operation still being sent (``planned``, ``submitted``) is not settled by it: WeChat Pay is
  answered 503 and notifies again later, when the executor has written what it saw;
- a settled operation is not changed: the same outcome again is a repeat (answered 204, nothing
  written), a different one is recorded as an event for support (``notification_contradicts``).

Refused, with nothing written (WeChat Pay's ``{"code": "FAIL", "message"}``, 4xx): a tenant
with no merchant or no APIv3 key, a signature that does not verify or is too old, a resource
that does not decrypt, another merchant's refund, an ``out_refund_no`` none of the tenant's
operations was sent with. The body, the keys and the ciphertext are never logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from outbox.downstream import Found, LookupMisuse, mismatch_evidence, settlement
from outbox.settings import Settings
from outbox.states import Event, State
from outbox.storage import storage_for
from outbox.storage.operations import operation_by_key
from outbox.storage.reviews import note_staff_action, open_review_id, settle_unknown
from outbox.storage.transitions import Transition, Unclaimed
from workers.wechatpay_notify import NotificationRefused, RefundNotice, read_notification
from workers.wechatpay_signing import MerchantKeys, UnreadableKey, merchant_keys

log = logging.getLogger(__name__)

#: The actor of every event a notification writes.
ACTOR = "wechatpay:notification"
#: The review reason of a notified refund that does not match the intent (a lookup's).
MISMATCH = "lookup_mismatch"
#: The longest body read (a refund notification is about a kilobyte).
MAX_BODY = 64 * 1024


class WechatPayNotifications:
    """Takes a tenant's notifications: checks them, then writes what they prove."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._sessions = sessions
        self._clock = clock
        self._keys: dict[str, MerchantKeys] = {}

    def accept(self, tenant: str, headers: Mapping[str, str], body: bytes) -> str:
        """What the notification did (``settled``, ``in_review``, ``repeat``,
        ``contradicts``); NotificationRefused, writing nothing, where it proves nothing."""
        keys, api_v3_key = self._merchant(tenant)
        notice = read_notification(keys, api_v3_key, headers, body, now=self._clock())
        with self._sessions.begin() as session:
            done = self._record(session, tenant, notice)
        log.info(
            "wechatpay notification taken",
            extra={"tenant": tenant, "notification": notice.id[:64], "outcome": done},
        )
        return done

    def _merchant(self, tenant: str) -> tuple[MerchantKeys, bytes]:
        merchant = self._settings.wechatpay_merchants.get(tenant)
        api_v3_key = merchant.api_v3_key_bytes() if merchant is not None else None
        if merchant is None or api_v3_key is None:
            raise NotificationRefused(
                "no_merchant", "no WeChat Pay merchant takes notifications here", 404
            )
        if tenant not in self._keys:
            try:
                self._keys[tenant] = merchant_keys(tenant, merchant)
            except UnreadableKey as exc:
                raise NotificationRefused("misconfigured", str(exc), 500) from None
        return self._keys[tenant], api_v3_key

    def _record(self, session: Session, tenant: str, notice: RefundNotice) -> str:
        op = operation_by_key(session, tenant, notice.out_refund_no)
        if op is None or self._settings.downstream_providers.get(op.kind) != "wechatpay":
            raise NotificationRefused(
                "unknown_refund", "no refund of this tenant has this out_refund_no", 404
            )
        lookup = notice.as_lookup(op.params)
        evidence: dict[str, Any] = {
            "evidence": "notification",
            "notification": notice.id[:64],
            "event_type": notice.event_type,
        }
        state = State(op.state)
        if state in (State.PLANNED, State.SUBMITTED):
            raise NotificationRefused(
                "not_yet", "the refund's send is not finished: notify again later", 503
            )
        if not isinstance(lookup, Found | LookupMisuse):
            raise NotificationRefused("malformed", "the refund is not readable", 400)
        storage = storage_for(self._sessions)
        if state is State.UNKNOWN and isinstance(lookup, Found):
            settled = settlement(lookup)
            reference = {"reference": lookup.receipt.reference, **settled.evidence}
            if settle_unknown(
                storage, session, op.id, Event.FIND, settled.state, actor=ACTOR,
                reason=settled.reason, receipt=settled.receipt,
                evidence={**evidence, **reference},
            ):  # fmt: skip
                return "settled"
            session.refresh(op)  # settled meanwhile (a lookup, staff): read what it is now
            state = State(op.state)
        if state is State.UNKNOWN:
            assert isinstance(lookup, LookupMisuse)
            if open_review_id(session, op.id) is not None:
                return "in_review"  # a repeat, or already in review: nothing new to say
            misfit = {**evidence, **mismatch_evidence(lookup), "review": MISMATCH}
            look = Transition(
                Unclaimed(op.id, State.UNKNOWN), None, State.UNKNOWN,
                evidence=misfit, review=MISMATCH, note=MISMATCH,
            )  # fmt: skip
            storage.write_transitions(session, [look], actor=ACTOR)
            return "in_review"
        agrees = isinstance(lookup, Found) and settlement(lookup).state is state
        if agrees:
            return "repeat"
        log.warning(
            "wechatpay notification contradicts a settled operation",
            extra={"tenant": tenant, "operation_id": op.id, "state": state.value},
        )
        status = lookup.receipt.raw.get("status") if isinstance(lookup, Found) else None
        note_staff_action(
            storage, session, op.id, actor=ACTOR, note="notification_contradicts",
            evidence={**evidence, "status": status, "state": state.value},
        )  # fmt: skip
        return "contradicts"


def _fail(refused: NotificationRefused) -> JSONResponse:
    """WeChat Pay's failure answer (it notifies again later)."""
    return JSONResponse({"code": "FAIL", "message": refused.message}, status_code=refused.status)


async def _body(request: Request) -> bytes | None:
    """The request's body, read up to ``MAX_BODY`` (None: longer; the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


notify_routes = APIRouter(include_in_schema=False)


@notify_routes.post("/notify/wechatpay/{tenant}")
async def wechatpay_notification(tenant: str, request: Request) -> Response:
    """A refund-result notification from WeChat Pay: 204 once taken, else ``FAIL``."""
    notifications: WechatPayNotifications = request.app.state.wechatpay_notifications
    body = await _body(request)
    try:
        if body is None:
            raise NotificationRefused("too_large", "the notification is too large", 413)
        await run_in_threadpool(notifications.accept, tenant, dict(request.headers), body)
    except NotificationRefused as refused:
        log.warning(
            "wechatpay notification refused",
            extra={"tenant": tenant[:64], "code": refused.code, "status": refused.status},
        )
        return _fail(refused)
    return Response(status_code=204)
