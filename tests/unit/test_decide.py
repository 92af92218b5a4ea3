"""The reconcile decision as an exhaustive table."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from outbox.downstream import (
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Receipt,
    Unavailable,
)
from outbox.errors import ReviewConflict
from outbox.kinds import DownstreamContract
from outbox.states import Event, RejectReason, State
from reconciler.decide import MAX_RECHECK, Situation, decide, not_found_doubt
from support.evidence import weigh

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
OK = Found(Receipt("re_1", "succeeded", {"amount_minor": 1}))
REFUSED = Found(Receipt("re_2", "rejected", {}), RejectReason.BUSINESS_REJECTED, "closed")
LOOKUPS: dict[str, LookupOutcome | None] = {
    "found_ok": OK,
    "found_refused": REFUSED,
    "not_found": LookupNotFound(),
    "unavailable": Unavailable("503"),
    "mismatch": LookupMisuse("receipt_mismatch", "amount differs"),
    "no_lookup_api": None,
}
CONTRACTS = {
    # a downstream that refuses requests past their deadline (the simulator's promise)
    "idempotent": DownstreamContract(enforces_deadline=True),
    "not_idempotent": DownstreamContract(idempotent=False, enforces_deadline=True),
    # the default: no fence, so a "not found" waits out the delay bound (5 min) as well
    "unfenced": DownstreamContract(),
}
TIMING = {
    # (seconds since the last send, seconds since first send, unknown for, deadline in)
    "fresh": (1, 1, 1, 3600),
    "quiet": (60, 60, 60, 3600),
    "overdue": (900, 900, 900, 3600),
    "past_deadline": (60, 60, 60, -1),
    "past_retention": (60, 25 * 3600, 60, 48 * 3600),
}


def situation(state: State, contract: str, timing: str, in_review: bool = False) -> Situation:
    last, first, unknown, deadline = TIMING[timing]
    return Situation(
        state=state,
        contract=CONTRACTS[contract],
        now=NOW,
        deadline=NOW + timedelta(seconds=deadline),
        first_sent_at=NOW - timedelta(seconds=first),
        last_sent_at=NOW - timedelta(seconds=last),
        unknown_since=NOW - timedelta(seconds=unknown),
        lookups=3,
        client_timeout=timedelta(seconds=10),
        review_after=timedelta(seconds=600),
        in_review=in_review,
    )


def expected(state: State, contract: str, timing: str, lookup: str) -> str:
    """The rules of issue 5, written independently of decide()."""
    if lookup in ("found_ok", "found_refused"):
        return "found"
    if state is State.SUBMITTED:
        return "abandoned"
    if lookup == "mismatch":
        return "review:lookup_mismatch"
    if lookup == "no_lookup_api":
        return (
            "review:no_lookup_without_idempotency"
            if contract == "not_idempotent"
            else "review:no_lookup_replay_cannot_settle"
        )
    if contract == "not_idempotent":
        return "review:ambiguous_without_idempotency"
    if lookup == "not_found":
        last = TIMING[timing][0]
        if timing == "fresh" or (contract == "unfenced" and last < 10 + 2 + 300):
            return "wait_quiescence"
        if timing == "past_retention":
            return "review:past_key_retention"
        return "requeued"
    assert lookup == "unavailable"
    if timing in ("overdue", "past_deadline"):
        return "review:lookup_unavailable"
    return "lookup_unavailable"


CASES = list(itertools.product([State.UNKNOWN, State.SUBMITTED], CONTRACTS, TIMING, LOOKUPS))


@pytest.mark.parametrize(("state", "contract", "timing", "lookup"), CASES)
def test_decision_table(state: State, contract: str, timing: str, lookup: str) -> None:
    s = situation(state, contract, timing)
    d = decide(s, LOOKUPS[lookup])
    want = expected(state, contract, timing, lookup)
    if want.startswith("review:"):
        assert (d.code, d.review) == ("to_review", want.split(":", 1)[1])
        assert d.event is None  # stays unknown: never rejected without evidence
        assert d.next_attempt_at is not None and NOW < d.next_attempt_at <= NOW + MAX_RECHECK
    else:
        assert d.code == want
        assert d.review is None
    if want == "found":
        assert d.event is Event.FIND
        assert d.receipt is not None
        if lookup == "found_ok":
            assert (d.to, d.reason) == (State.SUCCEEDED, None)
        else:
            assert (d.to, d.reason) == (State.REJECTED, RejectReason.BUSINESS_REJECTED)
    elif want == "abandoned":
        assert (d.event, d.to) == (Event.ABANDON, State.UNKNOWN)
    elif want == "requeued":
        assert (d.event, d.to) == (Event.REQUEUE, State.PLANNED)
    elif want == "wait_quiescence":
        assert d.event is None
        assert d.next_attempt_at == s.quiet_at
        assert d.next_attempt_at > NOW
    elif want == "lookup_unavailable":
        assert d.event is None
        assert d.next_attempt_at == NOW + timedelta(seconds=8)  # 2 ** lookups


def test_nothing_but_a_receipt_ever_settles_as_rejected_or_succeeded() -> None:
    for state, contract, timing, lookup in CASES:
        d = decide(situation(state, contract, timing), LOOKUPS[lookup])
        if d.to in (State.SUCCEEDED, State.REJECTED):
            assert lookup.startswith("found")
            assert d.receipt is not None
        assert d.to is not State.CANCELLED


def test_review_is_opened_once() -> None:
    s = situation(State.UNKNOWN, "not_idempotent", "quiet", in_review=True)
    d = decide(s, LookupNotFound())
    assert (d.code, d.review, d.event) == ("in_review", None, None)


def test_quiescence_is_longer_than_the_client_timeout_plus_processing_time() -> None:
    s = situation(State.UNKNOWN, "idempotent", "fresh")
    assert s.quiet_at == s.last_sent_at + timedelta(seconds=10) + s.contract.processing_time  # type: ignore[operator]
    unfenced = situation(State.UNKNOWN, "unfenced", "fresh")
    assert unfenced.quiet_at == s.quiet_at + timedelta(minutes=5)


def test_recheck_backoff_is_capped() -> None:
    s = situation(State.UNKNOWN, "idempotent", "quiet")
    many = Situation(**{**s.__dict__, "lookups": 40})
    assert decide(many, Unavailable("x")).next_attempt_at == NOW + MAX_RECHECK


# -- quiescence counts from the end of an attempt's lease; a "not found" is dated when asked -


def quiet_case(**kw: object) -> Situation:
    base = situation(State.UNKNOWN, "idempotent", "quiet")
    return Situation(**{**base.__dict__, **kw})  # type: ignore[arg-type]


def test_an_abandoned_attempt_is_quiet_only_after_its_lease_ends() -> None:
    """An attempt started 60 s ago whose sender held its lease until 1 s ago may have left
    just before the lease ended: "not found" proves nothing until the processing time passed."""
    s = quiet_case(sends=((NOW - timedelta(seconds=60), NOW - timedelta(seconds=1)),))
    assert s.quiet_at == NOW + timedelta(seconds=1)
    assert decide(s, LookupNotFound()).code == "wait_quiescence"
    later = quiet_case(
        sends=((NOW - timedelta(seconds=60), NOW - timedelta(seconds=3)),),
    )
    assert decide(later, LookupNotFound()).code == "requeued"


def test_every_attempt_counts_not_only_the_newest() -> None:
    s = quiet_case(
        sends=(
            (NOW - timedelta(seconds=90), NOW + timedelta(seconds=5)),  # an older, longer lease
            (NOW - timedelta(seconds=30), NOW - timedelta(seconds=20)),
        ),
    )
    assert s.quiet_at == NOW + timedelta(seconds=7)
    assert decide(s, LookupNotFound()).code == "wait_quiescence"


def test_an_attempt_without_bounds_counts_from_its_start_plus_the_client_timeout() -> None:
    s = quiet_case(sends=((NOW - timedelta(seconds=11), None),))
    assert s.quiet_at == NOW + timedelta(seconds=1)


def test_a_not_found_asked_before_quiescence_proves_nothing_even_if_answered_after() -> None:
    sends = ((NOW - timedelta(seconds=5), NOW - timedelta(seconds=3)),)  # quiet at NOW - 1 s
    asked_early = quiet_case(sends=sends, asked_at=NOW - timedelta(seconds=1.5))
    assert decide(asked_early, LookupNotFound()).code == "wait_quiescence"
    asked_late = quiet_case(sends=sends, asked_at=NOW - timedelta(seconds=0.5))
    assert decide(asked_late, LookupNotFound()).code == "requeued"


def test_not_found_inside_the_retention_margin_goes_to_review() -> None:
    contract = DownstreamContract(
        key_retention=timedelta(seconds=5),
        retention_margin=timedelta(seconds=1),
        enforces_deadline=True,
    )
    s = quiet_case(
        contract=contract,
        first_sent_at=NOW - timedelta(seconds=4.2),
        sends=((NOW - timedelta(seconds=4.2), NOW - timedelta(seconds=3)),),
    )
    d = decide(s, LookupNotFound())
    assert (d.code, d.review) == ("to_review", "past_key_retention")


# -- after a step of the database's clock, a "not found" waits for every send in flight ------

#: (timing, distrust until (s from NOW; None: no step), asked at (s from NOW; None: now),
#:  in review) -> the code decided, and when it looks again (s from NOW) where it waits
CLOCK_STEP = {
    "no_step": ("quiet", None, None, False, "requeued", None),
    "inside_the_window": ("quiet", 5, None, False, "wait_clock_step", 7),  # + processing 2 s
    "window_over_but_processing_time_left": ("quiet", -1, None, False, "wait_clock_step", 1),
    "window_and_processing_time_over": ("quiet", -2, None, False, "requeued", None),
    "asked_inside_answered_after": ("quiet", -2.5, -1, False, "wait_clock_step", 0),
    "overdue_still_waits": ("overdue", 5, None, False, "wait_clock_step", 7),
    "past_deadline_still_waits": ("past_deadline", 5, None, False, "wait_clock_step", 7),
    "in_review_waits_without_a_new_item": ("quiet", 5, None, True, "wait_clock_step", 7),
    "not_quiet_first": ("fresh", 5, None, False, "wait_quiescence", None),
    "before_the_retention_verdict": ("past_retention", 5, None, False, "wait_clock_step", 7),
    "then_the_retention_verdict": ("past_retention", -10, None, False, "to_review", None),
}


@pytest.mark.parametrize("case", sorted(CLOCK_STEP))
def test_a_not_found_is_not_trusted_until_sends_in_flight_at_a_clock_step_are_over(
    case: str,
) -> None:
    timing, until, asked, in_review, code, recheck = CLOCK_STEP[case]
    base = situation(State.UNKNOWN, "idempotent", timing, in_review=in_review)
    s = Situation(
        **{
            **base.__dict__,
            "clock_doubt_until": None if until is None else NOW + timedelta(seconds=until),
            "asked_at": None if asked is None else NOW + timedelta(seconds=asked),
        }
    )
    d = decide(s, LookupNotFound())
    assert d.code == code
    if code == "wait_clock_step":
        assert not_found_doubt(s) == "clock_step"
        assert (d.event, d.review) == (None, None)  # stays unknown, no review item opened
        assert d.next_attempt_at == NOW + timedelta(seconds=recheck)


def test_a_receipt_found_settles_despite_a_clock_step() -> None:
    s = quiet_case(clock_doubt_until=NOW + timedelta(seconds=30))
    assert decide(s, OK).code == "found"


def test_staff_cannot_resolve_rejected_on_a_not_found_inside_a_clock_step() -> None:
    with pytest.raises(ReviewConflict) as refused:
        weigh(LookupNotFound(), State.REJECTED, None, doubt="clock_step")
    assert (refused.value.code, refused.value.data["why"]) == ("not_found_unproven", "clock_step")
    overridden = weigh(LookupNotFound(), State.REJECTED, None, doubt="clock_step", override=True)
    assert overridden.unproven == "clock_step"


# -- what a "not found" rests on: the downstream's deadline fence, or the delay bound --------

FENCED = DownstreamContract(enforces_deadline=True, processing_time=timedelta(seconds=2))
UNFENCED = DownstreamContract(
    max_request_delay=timedelta(seconds=30), processing_time=timedelta(seconds=2)
)
START = NOW - timedelta(seconds=100)
#: an attempt whose outcome was written 1 s after it started, under a lease ending 15 s after
ANSWERED_EARLY = ((START, START + timedelta(seconds=1)),)
LEASE_END = (START + timedelta(seconds=15),)


def fence_case(contract: DownstreamContract, asked: datetime, **kw: object) -> Situation:
    values: dict[str, object] = {
        "contract": contract,
        "sends": ANSWERED_EARLY,
        "lease_ends": LEASE_END,
        "asked_at": asked,
        "now": asked,
    }
    return quiet_case(**{**values, **kw})


@pytest.mark.parametrize(
    ("contract", "quiet_after"),
    [
        # fenced: nothing the downstream accepts arrived after the lease end (the header's
        # deadline is the lease end less the clock margin, the downstream's clock at most
        # the clock margin behind), even when its client gave up earlier
        (FENCED, 15 + 2),
        # unfenced: from the attempt's end as its sender knew it, plus the delay bound
        (UNFENCED, 1 + 2 + 30),
    ],
    ids=["deadline_fence", "delay_bound"],
)
def test_a_not_found_is_trusted_exactly_from_the_contracts_quiet_time(
    contract: DownstreamContract, quiet_after: int
) -> None:
    quiet = START + timedelta(seconds=quiet_after)
    assert fence_case(contract, quiet).quiet_at == quiet
    just_before = fence_case(contract, quiet - timedelta(microseconds=1))
    assert decide(just_before, LookupNotFound()).code == "wait_quiescence"
    assert decide(just_before, LookupNotFound()).next_attempt_at == quiet
    at = decide(fence_case(contract, quiet), LookupNotFound())
    assert (at.code, at.event, at.to) == ("requeued", Event.REQUEUE, State.PLANNED)


def test_a_fenced_attempt_counts_from_its_lease_end_not_from_an_earlier_outcome() -> None:
    """The client got an answer (a reset) after 1 s, but a proxy may still hold its request:
    the fence stops it only at the deadline, i.e. the lease end."""
    early = fence_case(FENCED, START + timedelta(seconds=1 + 2))
    assert decide(early, LookupNotFound()).code == "wait_quiescence"


def test_an_unfenced_attempt_waits_the_delay_bound_even_after_its_lease_ended() -> None:
    s = fence_case(UNFENCED, START + timedelta(seconds=15 + 2))  # fenced, it would be quiet
    assert decide(s, LookupNotFound()).code == "wait_quiescence"


def test_a_fenced_attempt_without_a_recorded_lease_counts_from_its_outcome() -> None:
    """Attempts written before 0.2 have no lease end: their outcome's time is all there is."""
    s = fence_case(FENCED, START + timedelta(seconds=3), lease_ends=())
    assert s.quiet_at == START + timedelta(seconds=3)


@pytest.mark.parametrize(
    ("contract", "assumption"),
    [
        (FENCED, {"rests_on": "deadline_fence"}),
        (UNFENCED, {"rests_on": "delay_bound", "max_request_delay_seconds": 30.0}),
    ],
)
def test_a_requeue_records_which_assumption_its_not_found_rests_on(
    contract: DownstreamContract, assumption: dict[str, object]
) -> None:
    d = decide(fence_case(contract, NOW), LookupNotFound())
    assert d.code == "requeued"
    assert {k: d.evidence[k] for k in assumption} == assumption
    assert ("max_request_delay_seconds" in d.evidence) is (not contract.enforces_deadline)


def test_the_default_contract_rests_on_a_five_minute_delay_bound() -> None:
    contract = DownstreamContract()
    assert (contract.enforces_deadline, contract.rests_on) == (False, "delay_bound")
    assert contract.max_request_delay == timedelta(minutes=5)
