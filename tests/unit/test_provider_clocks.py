"""The time each provider's answers say, told by its gateway as the wire protocol's is
(``workers.downstream_time``): Stripe's and Alipay's ``Date``, WeChat Pay's signed
``Wechatpay-Timestamp``, each with a resolution of a whole second, against database time read
on the attempt's deadline; and what a whole second's resolution does to the episodes: none
from rounding alone, a lag beyond the margin still detected, an episode ended by an answer that
shows the lag certainly within the margin."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from outbox import wire
from outbox.clock import Deadline
from outbox.downstream import DownstreamRequest, LookupNotFound, NotSent, Unavailable, Unknown
from outbox.downstream_clock import DownstreamClocks, lag_of
from outbox.kinds import default_registry
from tests.support.alipay import app_key, private_pem, public_pem
from tests.support.wechatpay import FakeWechatPay, keys
from workers.alipay_gateway import AlipayApp, AlipayGateway
from workers.stripe_gateway import StripeGateway
from workers.wechatpay_gateway import WechatPayGateway
from workers.wechatpay_signing import TIMESTAMP_RESOLUTION, answer_time

T = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
REFUND = default_registry().get("refund")
PARAMS = {"order_id": "pi_3Nx", "amount_minor": 1500, "currency": "CNY", "payee": "P-7"}
REQUEST = DownstreamRequest("acme", "op-9", REFUND, "stl_k1", PARAMS)
#: what a provider's clock says: 15 s behind the database's, in whole seconds
SAID = T - timedelta(seconds=15)
DATE = {"Date": format_datetime(SAID, usegmt=True)}
#: every answer arrives this long after its request left (on the deadline's monotonic clock)
TRIP = 0.25

Told = list[tuple[object, ...]]


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class Clocked:
    """A deadline on a monotonic clock that only the answers move (``TRIP`` each)."""

    def __init__(self) -> None:
        self.mono = 100.0
        # the request leaves at monotonic 100: database time T + 50 s
        self.deadline = Deadline(T + s(60), 110.0, lambda: self.mono)

    def answer(
        self, respond: Callable[[httpx.Request], httpx.Response]
    ) -> Callable[[httpx.Request], httpx.Response]:
        def timed(request: httpx.Request) -> httpx.Response:
            self.mono += TRIP
            return respond(request)

        return timed

    def spans(self, answers: int) -> list[tuple[datetime, datetime]]:
        """Database time at each request's start and its answer's arrival."""
        start = T + s(50)
        return [(start + s(TRIP * n), start + s(TRIP * (n + 1))) for n in range(answers)]


# -- Stripe: every request's Date ------------------------------------------------------------


def stripe_answer(request: httpx.Request) -> httpx.Response:
    # Settled-Server-Time is the wire protocol's: a Stripe gateway never reads it
    headers = {**DATE, wire.SERVER_TIME: wire.format_deadline(T)}
    if request.url.path.startswith("/v1/payment_intents/"):
        intent = {"id": "pi_3Nx", "object": "payment_intent", "amount": 1500, "currency": "cny"}
        return httpx.Response(200, json=intent, headers=headers)
    if request.method == "GET":  # the lookup's list of the intent's refunds: none of ours
        return httpx.Response(200, json={"object": "list", "data": []}, headers=headers)
    error = {"error": {"type": "api_error", "message": "try again"}}
    return httpx.Response(500, json=error, headers=headers)


def test_stripe_tells_each_answers_date_in_whole_seconds_against_database_time() -> None:
    """A send is two round trips (the intent read, then the create), each measured; a lookup
    one per page; a refusal's answer as well as a success's."""
    clocked, told = Clocked(), []
    gw = StripeGateway(
        {"acme": SecretStr("sk_test_abc")},
        api_base="http://stripe.test",
        transport=httpx.MockTransport(clocked.answer(stripe_answer)),
        time_seen=lambda *args: told.append(args),
    )
    assert isinstance(gw.submit(REQUEST, deadline=clocked.deadline), Unknown)
    assert isinstance(gw.lookup(REQUEST, deadline=clocked.deadline), LookupNotFound)
    assert told == [
        ("refund", SAID, wire.DATE_RESOLUTION, start, arrival)
        for start, arrival in clocked.spans(3)
    ]


def test_stripe_without_a_listener_or_a_date_tells_nothing() -> None:
    told: Told = []
    answered: list[int] = []

    def bare(request: httpx.Request) -> httpx.Response:
        answered.append(1)
        return httpx.Response(500, json={"error": {"type": "api_error"}})

    gw = StripeGateway(
        {"acme": SecretStr("sk_test_abc")},
        api_base="http://stripe.test",
        transport=httpx.MockTransport(bare),
        time_seen=lambda *args: told.append(args),
    )
    # the intent read answered (a 500: the refund is not sent), its answer saying no time
    assert isinstance(gw.submit(REQUEST, deadline=Clocked().deadline), NotSent)
    assert answered and told == []
    quiet = StripeGateway(
        {"acme": SecretStr("sk_test_abc")},
        api_base="http://stripe.test",
        transport=httpx.MockTransport(stripe_answer),
    )
    assert isinstance(quiet.submit(REQUEST, deadline=Clocked().deadline), Unknown)  # no one told


# -- WeChat Pay: the signed timestamp of a verified answer -----------------------------------


def wechat(clocked: Clocked, told: Told, **fake: Any) -> WechatPayGateway:
    def query(request: httpx.Request) -> tuple[int, Any]:
        return 404, {"code": "RESOURCE_NOT_EXISTS", "message": "退款单不存在"}

    said = SAID.timestamp()
    answering = FakeWechatPay(query, clock=lambda: said + 0.9, **fake)  # truncated to SAID
    return WechatPayGateway(
        {"acme": keys()},
        order_totals=lambda tenant, order: 100000,
        api_base="https://api.mch.weixin.qq.com",
        transport=httpx.MockTransport(clocked.answer(answering)),
        clock=lambda: said,  # the gateway's own clock, for the signature's freshness
        time_seen=lambda *args: told.append(args),
    )


def test_wechatpay_tells_the_signed_timestamp_of_a_verified_answer_not_its_date() -> None:
    clocked, told = Clocked(), []

    def with_a_date(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
        return {**headers, "Date": format_datetime(T, usegmt=True)}, raw  # unsigned

    gw = wechat(clocked, told, tamper=with_a_date)
    assert isinstance(gw.lookup(REQUEST, deadline=clocked.deadline), LookupNotFound)
    ((start, arrival),) = clocked.spans(1)
    assert told == [("refund", SAID, TIMESTAMP_RESOLUTION, start, arrival)]


def test_an_answer_not_proven_wechatpays_says_nothing_of_its_clock() -> None:
    clocked, told = Clocked(), []

    def changed(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
        return headers, raw.replace(b"RESOURCE_NOT_EXISTS", b"SYSTEM_ERROR")

    gw = wechat(clocked, told, tamper=changed)
    assert isinstance(gw.lookup(REQUEST, deadline=clocked.deadline), Unavailable)
    assert told == []


@pytest.mark.parametrize("stamp", ["", "-5", "1.5", "١٢٣", "9" * 30])
def test_an_unreadable_wechatpay_timestamp_says_no_time(stamp: str) -> None:
    assert answer_time({"Wechatpay-Timestamp": stamp}) is None


def test_the_wechatpay_timestamp_is_read_by_any_case_of_its_name() -> None:
    stamp = str(int(SAID.timestamp()))
    assert answer_time({"wechatpay-timestamp": stamp}) == (SAID, TIMESTAMP_RESOLUTION)
    assert TIMESTAMP_RESOLUTION == wire.DATE_RESOLUTION == 1.0  # whole seconds, both


# -- Alipay: every answer's Date ---------------------------------------------------------------


def alipay(clocked: Clocked, told: Told, headers: dict[str, str]) -> AlipayGateway:
    app = AlipayApp(
        "2021000000000001",
        SecretStr(private_pem(app_key("app"))),
        public_pem(app_key("alipay").public_key()),
    )

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, content=json.dumps({"error": "busy"}), headers=headers)

    return AlipayGateway(
        {"acme": app},
        gateway_url="https://openapi.alipay.test/gateway.do",
        transport=httpx.MockTransport(clocked.answer(answer)),
        time_seen=lambda *args: told.append(args),
    )


def test_alipay_tells_each_answers_date_whatever_it_proves() -> None:
    """A 503 proves nothing of the refund, but it was written by the gateway's clock."""
    clocked, told = Clocked(), []
    gw = alipay(clocked, told, {**DATE, wire.SERVER_TIME: wire.format_deadline(T)})
    assert isinstance(gw.submit(REQUEST, deadline=clocked.deadline), Unknown)
    assert isinstance(gw.lookup(REQUEST, deadline=clocked.deadline), Unavailable)
    assert told == [
        ("refund", SAID, wire.DATE_RESOLUTION, start, arrival)
        for start, arrival in clocked.spans(2)
    ]


def test_alipay_without_a_date_tells_nothing() -> None:
    clocked, told = Clocked(), []
    gw = alipay(clocked, told, {})
    assert isinstance(gw.submit(REQUEST, deadline=clocked.deadline), Unknown)  # answered
    assert clocked.mono > 100 and told == []


def test_http_date_reads_only_date() -> None:
    """The wire protocol's millisecond header is no provider's: ``http_date`` ignores it."""
    headers = httpx.Headers({wire.SERVER_TIME: wire.format_deadline(T), **DATE})
    assert wire.http_date(headers) == (SAID, wire.DATE_RESOLUTION)
    assert wire.http_date(httpx.Headers({wire.SERVER_TIME: wire.format_deadline(T)})) is None
    assert wire.http_date({"Date": "not a date"}) is None


# -- whole seconds against the episodes --------------------------------------------------------


def date_lag(true_lag: float, written: float, trip: float = 0.05) -> Any:
    """One answer's lag as a whole-second time shows it: the downstream ``true_lag`` behind,
    writing its time ``written`` seconds into the database's second, ``trip`` after the
    request left."""
    db_start = T + s(written)
    truth = (db_start - s(true_lag)).timestamp()
    said = datetime.fromtimestamp(int(truth) if truth >= 0 else int(truth) - 1, UTC)
    return lag_of(said, wire.DATE_RESOLUTION, db_before=db_start, db_after=db_start + s(trip))


PHASES = [n / 20 for n in range(20)]  # where in its second each answer is written


def test_no_episode_from_rounding_to_whole_seconds_even_below_a_second_of_margin() -> None:
    """A downstream on time (or within the margin) whose time is rounded down by up to a
    second: the bound reaches past the margin, what is certain of the lag never does."""
    for true_lag in (0.0, 0.2):
        clocks = DownstreamClocks(margin=0.25)
        lags = [date_lag(true_lag, phase) for phase in PHASES]
        assert max(lag.bound for lag in lags) > 0.25  # the rounding shows in the bound...
        assert [clocks.observe("refund", lag) for lag in lags] == [None] * len(lags)
        assert not clocks.beyond("refund")  # ...and never starts an episode


def test_a_lag_beyond_the_margin_by_more_than_a_second_is_detected_at_the_first_answer() -> None:
    for phase in PHASES:
        clocks = DownstreamClocks(margin=1.0)
        episode = clocks.observe("refund", date_lag(2.1, phase))
        assert episode is not None and episode.begins, phase
        assert 2.1 <= episode.lag <= 2.1 + 1 + 0.05 + 0.1  # rounding, the trip, the record step


def test_a_lag_less_than_a_second_beyond_the_margin_is_seen_once_an_answer_shows_it() -> None:
    """Within a second beyond the margin, only an answer written early in its second makes it
    certain: the episode begins there, not before."""
    clocks = DownstreamClocks(margin=1.0)
    seen = [clocks.observe("refund", date_lag(1.5, phase)) is not None for phase in PHASES]
    first = seen.index(True)
    assert first > 0 and not any(seen[:first])
    assert clocks.beyond("refund")


def test_a_whole_second_episode_ends_at_an_answer_certainly_within_the_margin() -> None:
    clocks = DownstreamClocks(margin=1.0)
    assert clocks.observe("refund", date_lag(6.0, 0.3)) is not None
    # Set right: an answer written late in its second still leaves the bound past the margin
    clocks.observe("refund", date_lag(0.0, 0.99))
    assert clocks.beyond("refund")
    # the next one written early enough in its second ends it
    clocks.observe("refund", date_lag(0.0, 0.3))
    assert not clocks.beyond("refund")
