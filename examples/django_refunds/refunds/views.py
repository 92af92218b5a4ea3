"""The refund API: ``POST /refunds`` writes the app's own row and the operation intent in ONE
``transaction.atomic()`` block (both commit, or neither does; the hint goes out after the
commit), ``GET /refunds/<key>`` says where the refund stands.

The client's ``Idempotency-Key`` header names its request: a retransmission finds the stored
row and returns the same operation (no new row, no second send); the same key with another body
is a 409, bad input a 422, and neither writes anything.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from outbox import IdempotencyConflict, InvalidInput, InvalidSetting, NotFound, new_op_id
from refunds.models import RefundRequest
from settled.contrib import django as settled

#: A real app takes the tenant from its own authentication.
TENANT = "acme"
#: A client's request key (a UUID fits): kept as the operation's correlation id.
REQUEST_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,63}")
#: The body's fields and their JSON types, strictly ("100" is not an amount). Settled's refund
#: intent checks the rest (a positive amount in minor units, an ISO 4217 currency...).
FIELDS = {"order_id": str, "amount_minor": int, "currency": str, "payee": str}


def _refused(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"code": code, "message": message}, status=status)


def _params(request: HttpRequest) -> dict[str, Any] | None:
    """The body as the refund's params, or None if it is not exactly ``FIELDS``."""
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    if not isinstance(body, dict) or set(body) != set(FIELDS):
        return None
    for name, kind in FIELDS.items():
        value = body[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
    return body


@csrf_exempt  # an API called with a key, not a form in a browser
@require_POST
def file_refund(request: HttpRequest) -> JsonResponse:
    """File a refund: the business row and the operation intent in one transaction."""
    key = request.headers.get("Idempotency-Key", "")
    if REQUEST_KEY.fullmatch(key) is None:
        return _refused(
            422, "invalid_request_key", "Idempotency-Key: 1 to 64 of A-Z a-z 0-9 ._:/+=-"
        )
    params = _params(request)
    if params is None:
        return _refused(422, "invalid_body", f"a JSON object of exactly {sorted(FIELDS)}")
    try:
        # Check the intent before writing anything (InvalidParams: a 422, nothing written).
        settled.outbox().registry.get("refund").parse(params)
        with transaction.atomic():
            row, created = RefundRequest.objects.get_or_create(
                tenant=TENANT, request_key=key, defaults={"op_id": new_op_id(), **params}
            )
            # A replay with the same body returns the stored operation; with another body,
            # IdempotencyConflict, and the atomic block rolls the transaction back.
            got = settled.enqueue(
                tenant=TENANT, op_id=row.op_id, kind="refund", params=params, correlation_id=key
            )
    except IdempotencyConflict as exc:  # this key was first used with another body
        return _refused(409, exc.code, exc.message)
    except InvalidSetting:  # Settled is configured wrong: the server's fault, not the input's
        raise
    except InvalidInput as exc:  # rolled back: neither row was written
        return _refused(422, exc.code, exc.message)
    answer = {"request_key": key, "op_id": got.op_id, "state": got.state, "created": created}
    return JsonResponse(answer, status=201 if created else 200)


@require_GET
def refund_status(request: HttpRequest, request_key: str) -> JsonResponse:
    """The refund request and where its operation stands (done, not done, uncertain)."""
    row = RefundRequest.objects.filter(tenant=TENANT, request_key=request_key).first()
    if row is None:
        return _refused(404, "refund_not_found", "no such refund request")
    try:
        operation = settled.operation_status(TENANT, row.op_id)
    except NotFound:
        return _refused(404, "operation_not_found", "no such operation")
    filed = {k: getattr(row, k) for k in ("request_key", "order_id", "amount_minor", "currency")}
    return JsonResponse({"request": filed, "operation": operation})
