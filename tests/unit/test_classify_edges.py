"""The wire classifiers at the edges their tables step over: a business refusal is one only
from a 4xx (a 5xx with a business body may have executed), a misuse answer keeps its code, a
WeChat Pay system error is unknown whatever its HTTP status. Each test here was written to kill
a mutant the mutation suite let through (docs/mutation.md)."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from outbox import wire
from outbox.downstream import Misuse, NotExecuted, Refused, Unknown
from outbox.kinds import default_registry
from outbox.states import RejectReason
from workers import wechatpay_classify
from workers.http_classify import classify_submit

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P7"}


def _answer(status: int, type_: str, code: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": type_, "code": code, "message": "m"}})


def _classify(response: httpx.Response) -> object:
    return classify_submit(response, REFUND, PARAMS, now=NOW, idempotency_key="stl_k")


def test_a_business_body_on_a_server_error_is_unknown_not_a_refusal() -> None:
    got = _classify(_answer(500, wire.BUSINESS_ERROR, "insufficient_funds"))
    # the refund may have been made before the 500; staff read the downstream's code
    assert got == Unknown("server error insufficient_funds", 500)


@pytest.mark.parametrize("status", [399, 400, 499, 500])
def test_a_business_refusal_is_one_only_from_a_4xx(status: int) -> None:
    got = _classify(_answer(status, wire.BUSINESS_ERROR, "insufficient_funds"))
    refused = Refused(RejectReason.BUSINESS_REJECTED, "insufficient_funds", status)
    assert (got == refused) == (400 <= status < 500)
    assert not isinstance(got, Refused) or 400 <= status < 500


def test_an_idempotency_misuse_answer_keeps_its_code() -> None:
    got = _classify(_answer(400, wire.IDEMPOTENCY_ERROR, wire.KEY_REUSED))
    assert got == Misuse("idempotency_error", wire.KEY_REUSED, 400)


@pytest.mark.parametrize("status", [200, 400, 403])
def test_a_wechatpay_system_error_is_unknown_at_any_status(status: int) -> None:
    got = wechatpay_classify.classify_error(status, {"code": "SYSTEM_ERROR"}, {}, now=NOW)
    assert isinstance(got, Unknown)


@pytest.mark.parametrize("status", [400, 403, 429])
def test_a_wechatpay_frequency_limit_is_not_executed_at_any_status(status: int) -> None:
    got = wechatpay_classify.classify_error(status, {"code": "FREQUENCY_LIMITED"}, {}, now=NOW)
    assert isinstance(got, NotExecuted)
