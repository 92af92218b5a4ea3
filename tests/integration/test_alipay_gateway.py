"""The Alipay gateway against the simulator's Alipay mode: exactly one HTTP request per call,
RSA2 checked both ways (an answer that does not verify proves nothing; a request signed by
another key, or changed after signing, is refused by the mode), and no key in any error text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from pydantic import SecretStr

from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    NotExecuted,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason
from settled.simulator import SimulatorControl
from tests.support.alipay import (
    app_key,
    gateway_url,
    private_pem,
    public_pem,
    register_app,
    unregistered_key_app,
)
from tests.support.simtools import SimTenant
from workers.alipay_gateway import AlipayApp, AlipayGateway
from workers.transport import BoundedTransport

REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


class Counting(httpx.BaseTransport):
    """The bounded transport, counting requests; ``edit`` may change each answer's body."""

    def __init__(self, edit: Callable[[bytes], bytes] | None = None) -> None:
        self.inner = BoundedTransport()
        self.edit = edit
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = self.inner.handle_request(request)
        if self.edit is None:
            return response
        body = self.edit(response.read())
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    def close(self) -> None:
        self.inner.close()


def deadline() -> datetime:
    return datetime.now(UTC) + timedelta(seconds=5)


def refund(key: str, **params: object) -> DownstreamRequest:
    return DownstreamRequest("acme", f"op-{key}", REFUND, key, {**PARAMS, **params})


@pytest.fixture
def app(sim_control: SimulatorControl, sim_tenant: SimTenant) -> AlipayApp:
    sim_control.create_order(sim_tenant.name, "A1042", 100000)
    return register_app(sim_control, sim_tenant.name)


@pytest.fixture
def make(simulator_url: str, app: AlipayApp) -> Iterator[Callable[..., AlipayGateway]]:
    made: list[AlipayGateway] = []

    def gateway(transport: httpx.BaseTransport, the_app: AlipayApp = app) -> AlipayGateway:
        g = AlipayGateway(
            {"acme": the_app}, gateway_url=gateway_url(simulator_url), transport=transport
        )
        made.append(g)
        return g

    yield gateway
    for g in made:
        g.close()


@pytest.fixture
def simulator_url(simulator: object) -> str:
    return str(simulator.url)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (None, Accepted),
        ("commit_then_reset", Unknown),
        ("503_after_commit", Unknown),
        ("429", NotExecuted),
        ("reset_before", Unknown),
        ("business_reject", Refused),
    ],
)
def test_each_send_is_exactly_one_http_request(
    make: Callable[..., AlipayGateway],
    sim_control: SimulatorControl,
    fault: str | None,
    expected: type,
) -> None:
    """No retry inside the gateway, whatever came back: the executor is the one retry owner."""
    counting = Counting()
    gateway = make(counting)
    if fault is not None:
        sim_control.add_rule(fault, times=1)  # type: ignore[arg-type]
    outcome = gateway.submit(refund("stl_one"), deadline=deadline())
    assert isinstance(outcome, expected), outcome
    assert len(counting.requests) == 1
    assert sim_control.requests("acme", "stl_one") == 1
    looked = gateway.lookup(refund("stl_one"), deadline=deadline())
    assert len(counting.requests) == 2, looked
    assert sim_control.requests("acme", "stl_one", phase="lookup") == 1


def test_the_request_is_a_signed_form_of_alipay_trade_refund(
    make: Callable[..., AlipayGateway], app: AlipayApp
) -> None:
    counting = Counting()
    assert isinstance(make(counting).submit(refund("stl_form"), deadline=deadline()), Accepted)
    (sent,) = counting.requests
    form = dict(httpx.QueryParams(sent.content.decode()))
    assert sent.method == "POST" and sent.url.path == "/alipay/gateway.do"
    assert form["method"] == "alipay.trade.refund" and form["sign_type"] == "RSA2"
    assert form["app_id"] == app.app_id and form["version"] == "1.0"
    assert json.loads(form["biz_content"]) == {
        "out_trade_no": "A1042",
        "refund_amount": "100.00",
        "out_request_no": "stl_form",
    }


def _tamper_amount(body: bytes) -> bytes:
    return body.replace(b'"send_back_fee": "100.00"', b'"send_back_fee": "10.00"')


def _drop_sign(body: bytes) -> bytes:
    document = json.loads(body)
    document.pop("sign")
    return json.dumps(document).encode()


def _refusal_for_success(body: bytes) -> bytes:
    """A success made to read as a business refusal (with the original signature)."""
    return body.replace(b'"code": "10000"', b'"code": "40004", "sub_code": "ACQ.TRADE_NOT_EXIST"')


def _other_signature(body: bytes) -> bytes:
    document = json.loads(body)
    document["sign"] = document["sign"][::-1]
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    "edit", [_tamper_amount, _drop_sign, _refusal_for_success, _other_signature]
)
def test_an_answer_that_does_not_verify_proves_nothing(
    make: Callable[..., AlipayGateway],
    sim_control: SimulatorControl,
    edit: Callable[[bytes], bytes],
) -> None:
    """The refund was made (one effect); a changed or unsigned answer is neither a success nor
    a refusal: uncertain, and the query (verified) settles it."""
    gateway = make(Counting(edit))
    outcome = gateway.submit(refund("stl_tampered"), deadline=deadline())
    assert isinstance(outcome, Unknown), outcome
    assert "not signed by Alipay" in outcome.detail
    assert sim_control.effects("acme", "stl_tampered") == 1
    assert isinstance(make(Counting()).lookup(refund("stl_tampered"), deadline=deadline()), Found)


def _tamper_query_amount(body: bytes) -> bytes:
    return body.replace(b'"refund_amount": "100.00"', b'"refund_amount": "1.00"')


@pytest.mark.parametrize("edit", [_tamper_query_amount, _drop_sign, _other_signature])
def test_a_query_answer_that_does_not_verify_settles_nothing(
    make: Callable[..., AlipayGateway], edit: Callable[[bytes], bytes]
) -> None:
    assert isinstance(make(Counting()).submit(refund("stl_q"), deadline=deadline()), Accepted)
    looked = make(Counting(edit)).lookup(refund("stl_q"), deadline=deadline())
    assert isinstance(looked, Unavailable) and not looked.pending, looked
    assert "not signed by Alipay" in looked.detail


def test_an_answer_signed_by_a_key_other_than_alipays_proves_nothing(
    make: Callable[..., AlipayGateway], app: AlipayApp
) -> None:
    impostor = public_pem(app_key("impostor").public_key())
    trusting_another = AlipayApp(app.app_id, app.private_key, impostor)
    outcome = make(Counting(), trusting_another).submit(refund("stl_key"), deadline=deadline())
    assert isinstance(outcome, Unknown), outcome


def test_a_request_signed_by_another_key_is_refused_as_our_credentials(
    make: Callable[..., AlipayGateway], sim_control: SimulatorControl, app: AlipayApp
) -> None:
    outcome = make(Counting(), unregistered_key_app(app)).submit(
        refund("stl_wrong"), deadline=deadline()
    )
    assert isinstance(outcome, Refused), outcome
    assert (outcome.reason, outcome.code) == (
        RejectReason.PERMISSION_DENIED,
        "isv.invalid-signature",
    )
    assert sim_control.effects("acme", "stl_wrong") == 0


def test_a_request_changed_after_signing_is_refused_by_the_mode(
    simulator_url: str, app: AlipayApp, sim_control: SimulatorControl
) -> None:
    """The simulator checks the request's signature: an amount changed on the way is not
    executed."""
    counting = Counting()
    with AlipayGateway({"acme": app}, gateway_url=gateway_url(simulator_url)) as gateway:
        assert isinstance(gateway.submit(refund("stl_signed"), deadline=deadline()), Accepted)
    form = {"out_trade_no": "A1042", "refund_amount": "1.00", "out_request_no": "stl_changed"}
    signed = _signed_form(app, form)
    signed["biz_content"] = signed["biz_content"].replace('"1.00"', '"900.00"')
    with httpx.Client(transport=counting) as client:
        answer = client.post(gateway_url(simulator_url), data=signed).json()
    node = answer["alipay_trade_refund_response"]
    assert (node["code"], node["sub_code"]) == ("40002", "isv.invalid-signature")
    assert sim_control.effects("acme", "stl_changed") == 0


def _signed_form(app: AlipayApp, biz: dict[str, str]) -> dict[str, str]:
    from workers.alipay_gateway import load_private_key, sign, signing_content

    form = {
        "app_id": app.app_id,
        "method": "alipay.trade.refund",
        "format": "JSON",
        "charset": "utf-8",
        "sign_type": "RSA2",
        "timestamp": "2026-12-03 14:12:05",
        "version": "1.0",
        "biz_content": json.dumps(biz),
    }
    key = load_private_key(app.private_key.get_secret_value())
    form["sign"] = sign(key, signing_content(form))
    return form


def test_a_currency_alipay_does_not_refund_in_is_refused_before_sending(
    make: Callable[..., AlipayGateway],
) -> None:
    counting = Counting()
    outcome = make(counting).submit(refund("stl_usd", currency="USD"), deadline=deadline())
    assert isinstance(outcome, Refused) and outcome.code == "currency_not_supported"
    assert outcome.reason is RejectReason.INVALID_PARAMS
    assert counting.requests == []


def test_no_key_appears_in_the_error_of_an_unreadable_one(app: AlipayApp) -> None:
    secret = private_pem(app_key())
    broken = secret.replace("A", "*")
    bad = AlipayApp(app.app_id, SecretStr(broken), app.alipay_public_key)
    with pytest.raises(ValueError, match="not a readable RSA private key") as raised:
        AlipayGateway({"acme": bad})
    text = str(raised.value)
    assert "acme" in text and "private key" in text
    assert broken[40:80] not in text and secret[40:80] not in text
    assert secret[40:80] not in repr(app)
