"""The downstream's clock measured against the database's: the pure arithmetic, the episodes,
the wire protocol's time, and the fence that allows for a lag beyond the clock margin."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from pydantic import SecretStr

from outbox import wire
from outbox.clock import Deadline
from outbox.downstream import DownstreamRequest, LookupNotFound
from outbox.downstream_clock import (
    MAX_CORRECTION,
    DownstreamClocks,
    Lag,
    corrected_deadline,
    fence_excess,
    lag_of,
)
from outbox.kinds import DownstreamContract, KindRegistry, default_registry
from outbox.quiescence import quiet_at
from outbox.states import State
from reconciler.decide import Situation, decide
from workers.http_client import HttpGateway

T = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 100, "currency": "CNY", "payee": "P-7"}


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# -- one round trip's lag ------------------------------------------------------------------


def test_a_downstream_behind_is_bounded_by_the_answers_arrival() -> None:
    """Asked at database time T, answered by T + 0.2 s with a clock saying T - 6 s: at most
    6.2 s behind (it may have written its time as the answer left), at least 6 s less the
    round trip and the resolution."""
    lag = lag_of(T - s(6), 0.001, db_before=T, db_after=T + s(0.2))
    assert lag.bound == pytest.approx(6.2)
    assert lag.certain == pytest.approx(6.2 - 0.2 - 0.001)
    assert lag.at == T + s(0.2)


def test_a_whole_second_date_widens_only_the_certain_side() -> None:
    """``Date`` truncates: the true time is up to a second later than said, so the downstream
    may be less behind than the bound, never more."""
    lag = lag_of(T, wire.DATE_RESOLUTION, db_before=T, db_after=T + s(0.5))
    assert lag.bound == pytest.approx(0.5)
    assert lag.certain == pytest.approx(-1.0)


def test_a_downstream_ahead_shows_a_negative_lag() -> None:
    lag = lag_of(T + s(3), 0.001, db_before=T, db_after=T + s(0.1))
    assert lag.bound == pytest.approx(-2.9)


def test_an_answer_before_its_request_is_refused() -> None:
    with pytest.raises(ValueError, match="before its request"):
        lag_of(T, 0.001, db_before=T, db_after=T - s(1))
    with pytest.raises(ValueError, match="resolution"):
        lag_of(T, -1, db_before=T, db_after=T)


def test_an_exact_time_and_an_instant_answer_are_read() -> None:
    """A resolution of 0 (a time said exactly) and an answer in no time are not errors."""
    assert lag_of(T - s(2), 0.0, db_before=T, db_after=T) == Lag(2.0, 2.0, T)


@pytest.mark.parametrize(
    ("lag", "margin", "excess"),
    [(None, 1.0, 0.0), (0.4, 1.0, 0.0), (1.0, 1.0, 0.0), (6.2, 1.0, 5.2), (-3.0, 1.0, 0.0)],
)
def test_the_fence_allows_for_the_lag_beyond_the_margin_only(
    lag: float | None, margin: float, excess: float
) -> None:
    assert fence_excess(lag, margin) == s(excess)


# -- episodes beyond the margin ------------------------------------------------------------


def lag(bound: float, certain: float | None = None, at: datetime = T) -> Lag:
    return Lag(bound, bound if certain is None else certain, at)


def test_an_episode_begins_once_grows_in_steps_and_ends_within_the_margin() -> None:
    clocks = DownstreamClocks(margin=1.0)
    assert clocks.observe("refund", lag(0.3)) is None
    begun = clocks.observe("refund", lag(6.02, 5.9))
    assert begun is not None and begun.begins and begun.lag == pytest.approx(6.1)
    assert clocks.beyond("refund")
    assert clocks.observe("refund", lag(6.05)) is None  # within the step recorded
    grown = clocks.observe("refund", lag(6.31))
    assert grown is not None and not grown.begins and grown.lag == pytest.approx(6.4)
    assert clocks.observe("refund", lag(0.2)) is None
    assert not clocks.beyond("refund")
    again = clocks.observe("refund", lag(3.0))
    assert again is not None and again.begins  # a new episode: counted again


def test_an_episode_is_beyond_the_margin_strictly_and_ends_at_the_margin() -> None:
    """Certainly at the margin is within it: no episode; in one, a bound back at the margin
    ends it."""
    clocks = DownstreamClocks(margin=1.0)
    assert clocks.observe("refund", lag(1.5, 1.0)) is None
    assert not clocks.beyond("refund")
    assert clocks.observe("refund", lag(1.5, 1.01)) is not None
    assert clocks.observe("refund", lag(1.0)) is None
    assert not clocks.beyond("refund")


@pytest.mark.parametrize(
    ("bound", "recorded"),
    [(6.2, 6.2), (6.1000002, 6.2), (6.10000005, 6.1)],
    ids=["on_a_step", "a_fifth_of_a_microsecond_past", "float_noise_past"],
)
def test_an_episodes_lag_is_recorded_rounded_up_to_the_step_float_noise_aside(
    bound: float, recorded: float
) -> None:
    """Never recorded below its bound by more than the float noise of the division (under a
    tenth of a microsecond), nor a step above it for that noise."""
    episode = DownstreamClocks(margin=1.0).observe("refund", lag(bound))
    assert episode is not None and episode.lag == pytest.approx(recorded, abs=1e-9)


def test_the_newest_samples_are_kept_the_oldest_forgotten() -> None:
    """``KEPT`` answers per downstream: the oldest of them still counts, one more drops it."""
    clocks = DownstreamClocks(margin=100.0)
    clocks.observe("refund", lag(9.0))
    for _ in range(255):
        clocks.observe("refund", lag(0.5))
    assert clocks.worst("refund", since=T) == 9.0  # the oldest of 256
    clocks.observe("refund", lag(0.5))
    assert clocks.worst("refund", since=T) == 0.5


def test_a_lag_beyond_the_margin_only_by_its_rounding_starts_no_episode() -> None:
    """A ``Date`` a second coarse says 1.5 s behind at most, maybe 0.5 s: not an alarm, but
    the fence still allows for the bound."""
    clocks = DownstreamClocks(margin=1.0)
    assert clocks.observe("refund", lag(1.5, 0.5)) is None
    assert not clocks.beyond("refund")
    assert clocks.worst("refund", since=T) == 1.5


def test_the_worst_lag_is_per_downstream_and_since_a_time() -> None:
    clocks = DownstreamClocks(margin=1.0)
    clocks.observe("refund", lag(6.0, at=T))
    clocks.observe("refund", lag(0.1, at=T + s(60)))
    clocks.observe("payout", lag(0.2, at=T))
    assert clocks.worst("refund", since=T) == 6.0
    assert clocks.worst("refund", since=T + s(1)) == 0.1
    assert clocks.worst("payout", since=T) == 0.2
    assert clocks.worst("ticket", since=T) is None


# -- the wire protocol's time ----------------------------------------------------------------


def test_the_server_time_header_is_read_to_the_millisecond() -> None:
    said = wire.server_time({wire.SERVER_TIME: "2026-12-06T12:00:00.250Z"})
    assert said == (T + s(0.25), wire.SERVER_TIME_RESOLUTION)


def test_date_is_the_fallback_with_a_seconds_resolution() -> None:
    said = wire.server_time({wire.DATE: "Sun, 06 Dec 2026 12:00:00 GMT"})
    assert said == (T, wire.DATE_RESOLUTION)
    unreadable = {wire.SERVER_TIME: "soon", wire.DATE: "Sun, 06 Dec 2026 12:00:00 GMT"}
    assert wire.server_time(unreadable) == (T, wire.DATE_RESOLUTION)


@pytest.mark.parametrize(
    "headers",
    [{}, {wire.DATE: "yesterday"}, {wire.SERVER_TIME: "2026-12-06T12:00:00"}],
    ids=["none", "unreadable_date", "naive_server_time"],
)
def test_an_answer_without_a_readable_time_says_none(headers: dict[str, str]) -> None:
    assert wire.server_time(headers) is None


# -- the fence allows for the measured lag ---------------------------------------------------

FENCED = DownstreamContract(enforces_deadline=True, processing_time=s(2))
UNFENCED = DownstreamContract(max_request_delay=s(30), processing_time=s(2))
START = T - s(100)
#: answered after 1 s, under a lease ending 15 s after the start
SENDS = ((START, START + s(1)),)
LEASE_ENDS = (START + s(15),)


def held(contract: DownstreamContract, asked: datetime, lag: float | None) -> Situation:
    return Situation(
        state=State.UNKNOWN,
        contract=contract,
        now=asked,
        deadline=T + s(3600),
        first_sent_at=START,
        last_sent_at=START,
        unknown_since=START + s(1),
        lookups=1,
        client_timeout=s(10),
        review_after=s(600),
        in_review=False,
        asked_at=asked,
        sends=SENDS,
        lease_ends=LEASE_ENDS,
        downstream_lag=None if lag is None else s(lag),
        clock_margin=s(1),
    )


def test_a_downstream_six_seconds_behind_moves_the_fence_five_seconds_later() -> None:
    """The review's case: the header's deadline D is at most the lease end less the 1 s margin,
    in database time; a downstream 6 s behind accepts until database time D + 6 s = lease end
    + 5 s. A "not found" before then plus processing may be a request still held."""
    quiet = LEASE_ENDS[0] + s(5) + s(2)
    assert held(FENCED, quiet, 6.0).quiet_at == quiet
    early = held(FENCED, quiet - s(0.001), 6.0)
    assert decide(early, LookupNotFound()).code == "wait_quiescence"
    assert decide(early, LookupNotFound()).next_attempt_at == quiet
    trusted = decide(held(FENCED, quiet, 6.0), LookupNotFound())
    assert trusted.code == "requeued"
    assert trusted.evidence["downstream_lag_seconds"] == 6.0


@pytest.mark.parametrize("lag", [None, 0.0, 0.9, 1.0, -5.0], ids=str)
def test_a_lag_within_the_margin_or_unmeasured_keeps_the_fence_at_the_lease_end(
    lag: float | None,
) -> None:
    """A downstream that says no time keeps today's rule: its clock within the margin."""
    at = LEASE_ENDS[0] + s(2)
    assert held(FENCED, at, lag).quiet_at == at
    assert decide(held(FENCED, at, lag), LookupNotFound()).code == "requeued"


def test_an_unfenced_contract_does_not_read_the_downstreams_clock() -> None:
    """The delay bound is a duration, not a time on the downstream's clock."""
    assert held(UNFENCED, T, 6.0).quiet_at == held(UNFENCED, T, None).quiet_at


def test_the_arithmetic_adds_the_excess_to_fenced_attempts_only() -> None:
    bounds = {"sends": SENDS, "lease_ends": LEASE_ENDS, "client_timeout": s(10), "now": T}
    fenced = quiet_at(FENCED, lag_excess=s(5), **bounds)  # type: ignore[arg-type]
    assert fenced == LEASE_ENDS[0] + s(5) + s(2)
    unfenced = quiet_at(UNFENCED, lag_excess=s(5), **bounds)  # type: ignore[arg-type]
    assert unfenced == quiet_at(UNFENCED, **bounds)  # type: ignore[arg-type]
    assert quiet_at(FENCED, lag_excess=-s(5), **bounds) == LEASE_ENDS[0] + s(2)  # type: ignore[arg-type]


# -- the HTTP gateway tells what each answer says --------------------------------------------


def gateway_telling(
    headers: dict[str, str], told: list[tuple[object, ...]], mono: list[float] | None = None
) -> HttpGateway:
    def respond(request: httpx.Request) -> httpx.Response:
        if mono is not None:
            mono[0] += 0.25  # the round trip
        if request.method == "GET":
            body = {"error": {"type": "not_found", "code": "idempotency_key_not_found"}}
            return httpx.Response(404, json=body, headers=headers)
        return httpx.Response(503, json={"error": {"type": "api_error"}}, headers=headers)

    return HttpGateway(
        "https://pay.example",
        {"acme": SecretStr("sk_test_1")},
        transport=httpx.MockTransport(respond),
        time_seen=lambda *args: told.append(args),
    )


def test_every_answer_of_submit_and_lookup_tells_the_downstreams_time_against_database_time() -> (
    None
):
    """Database time is the deadline's (a claim's reading), read on its own monotonic clock at
    the request's start and at the answer's arrival: 0.25 s apart here."""
    mono = [100.0]
    deadline = Deadline(T + s(60), 110.0, lambda: mono[0])
    told: list[tuple[object, ...]] = []
    gw = gateway_telling({wire.SERVER_TIME: "2026-12-06T11:59:45.000Z"}, told, mono)
    request = DownstreamRequest("acme", "op-1", REFUND, "stl_k1", PARAMS)
    gw.submit(request, deadline=deadline)
    start, arrival = T + s(60 - 10), T + s(60 - 10 + 0.25)
    assert told == [("refund", T - s(15), wire.SERVER_TIME_RESOLUTION, start, arrival)]
    told.clear()
    assert isinstance(gw.lookup(request, deadline=deadline), LookupNotFound)
    assert [t[:3] for t in told] == [("refund", T - s(15), wire.SERVER_TIME_RESOLUTION)]


def test_a_downstream_that_says_no_time_is_not_measured() -> None:
    """Today's behaviour for it: its clock is assumed within the clock margin."""
    told: list[tuple[object, ...]] = []
    gw = gateway_telling({}, told)
    request = DownstreamRequest("acme", "op-1", REFUND, "stl_k1", PARAMS)
    gw.submit(request, deadline=T + s(60))
    gw.lookup(request, deadline=T + s(60))
    assert told == []


# -- the sender's Settled-Deadline corrected by the measured lag ---------------------------------


@pytest.mark.parametrize("lag", [None, 0.0, -0.0, -0.5, -6.0, float("nan")], ids=str)
def test_a_deadline_is_never_corrected_later_nor_without_a_lag_behind(lag: float | None) -> None:
    assert corrected_deadline(T, lag) == T


@pytest.mark.parametrize("lag", [0.001, 6.2, 3600.0])
def test_a_downstream_behind_is_told_a_deadline_that_much_earlier(lag: float) -> None:
    """Its fence, by its clock ``lag`` behind, then cuts at ``T`` in database time."""
    assert corrected_deadline(T, lag) == T - s(lag)


def test_a_correction_is_capped_so_no_time_said_moves_the_header_out_of_the_calendar() -> None:
    """A ``Date`` of the year 1 bounds a lag of two thousand years: the header moves a day."""
    year_one = lag_of(datetime(1, 1, 1, tzinfo=UTC), 1.0, db_before=T, db_after=T)
    assert corrected_deadline(T, year_one.bound) == T - s(MAX_CORRECTION)
    assert corrected_deadline(T, MAX_CORRECTION + 1) == T - s(MAX_CORRECTION)
    assert corrected_deadline(T, 1e6) == T - timedelta(days=1)
    assert corrected_deadline(T, 86399.5) == T - s(86399.5)


def test_the_newest_answer_says_the_lag_a_header_is_corrected_by() -> None:
    clocks = DownstreamClocks(margin=1.0)
    assert clocks.latest("refund") is None
    clocks.observe("refund", lag_of(T - s(6), 0.001, db_before=T, db_after=T + s(0.2)))
    clocks.observe("refund", lag_of(T - s(2), 0.001, db_before=T, db_after=T + s(0.1)))
    assert clocks.latest("refund") == pytest.approx(2.1)  # set right: followed at once
    assert clocks.latest("other") is None


def gateway_correcting(lag: float | None, sent: list[httpx.Request]) -> HttpGateway:
    def respond(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        body = {"error": {"type": "not_found", "code": "idempotency_key_not_found"}}
        return httpx.Response(404 if request.method == "GET" else 503, json=body)

    return HttpGateway(
        "https://pay.example",
        {"acme": SecretStr("sk_test_1")},
        transport=httpx.MockTransport(respond),
        lag_seen={"refund": lag}.get,
    )


FENCED_REGISTRY = default_registry().with_contract("refund", enforces_deadline=True)


def told_deadlines(lag: float | None, registry: KindRegistry) -> list[datetime | None]:
    sent: list[httpx.Request] = []
    gw = gateway_correcting(lag, sent)
    request = DownstreamRequest("acme", "op-1", registry.get("refund"), "stl_k1", PARAMS)
    deadline = Deadline(T + s(5), 100.0, lambda: 95.0)  # 5 s left: the timeout caps nothing
    gw.submit(request, deadline=deadline)
    gw.lookup(request, deadline=deadline)
    return [wire.parse_deadline(r.headers[wire.DEADLINE]) for r in sent]


def test_a_fenced_kinds_header_is_earlier_by_the_lag_last_measured() -> None:
    assert told_deadlines(6.2, FENCED_REGISTRY) == [T + s(5) - s(6.2)] * 2


@pytest.mark.parametrize("lag", [None, -3.0], ids=["unmeasured", "ahead"])
def test_a_fenced_kinds_header_is_not_moved_without_a_lag_behind(lag: float | None) -> None:
    assert told_deadlines(lag, FENCED_REGISTRY) == [T + s(5)] * 2


def test_an_unfenced_kinds_header_is_never_moved() -> None:
    """Its 408 would go to review, not be sent again: the header stays the send's bound."""
    assert told_deadlines(6.2, default_registry()) == [T + s(5)] * 2
