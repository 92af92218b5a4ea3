"""The reconcile decision at the edges its table (test_decide.py) steps over: the exact moment
the key retention ends, which time "unknown for how long" counts from, and an operation known
only by its first send. Each test here was written to kill a mutant the suite let through
(docs/mutation.md); the test names the rule, not the mutant."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from outbox.downstream import Found, LookupNotFound, Receipt, Unavailable
from outbox.kinds import DownstreamContract
from outbox.quiescence import landing_slack
from outbox.states import State
from reconciler.decide import Situation, decide, not_found_doubt

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
FENCED = DownstreamContract(enforces_deadline=True)
TIMEOUT = timedelta(seconds=10)


def _situation(**changes: object) -> Situation:
    base = Situation(
        state=State.UNKNOWN,
        contract=FENCED,
        now=NOW,
        deadline=NOW + timedelta(days=2),
        first_sent_at=NOW - timedelta(minutes=5),
        last_sent_at=NOW - timedelta(minutes=5),
        unknown_since=NOW - timedelta(minutes=5),
        lookups=1,
        client_timeout=TIMEOUT,
        review_after=timedelta(minutes=10),
        in_review=False,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_not_found_is_distrusted_from_the_very_moment_the_retention_ends() -> None:
    first = NOW - FENCED.key_retention + FENCED.retention_margin  # resend_until(first) == NOW
    at_the_end = _situation(first_sent_at=first)
    assert FENCED.resend_until(first) == NOW
    assert at_the_end.past_retention
    assert not_found_doubt(at_the_end) == "past_key_retention"
    just_before = _situation(first_sent_at=first + timedelta(microseconds=1))
    assert not just_before.past_retention
    assert decide(just_before, LookupNotFound()).code == "requeued"


def test_an_operation_never_sent_is_not_past_retention() -> None:
    # no attempt recorded (e.g. a lease lost before the first send): no key to forget, and a
    # "not found" still waits its client timeout and landing slack from now
    never = _situation(first_sent_at=None, last_sent_at=None)
    assert not never.past_retention
    assert not_found_doubt(never) == "not_quiet"
    change = decide(never, LookupNotFound())
    assert change.code == "wait_quiescence"
    assert change.next_attempt_at == NOW + TIMEOUT + landing_slack(FENCED)


def test_unknown_for_counts_from_when_it_became_unknown_not_from_the_send() -> None:
    # sent an hour ago, unknown only since a minute: not yet due for review
    recent = _situation(
        last_sent_at=NOW - timedelta(hours=1), unknown_since=NOW - timedelta(minutes=1)
    )
    assert not recent.overdue
    assert decide(recent, Unavailable("503")).code == "lookup_unavailable"


def test_without_unknown_since_it_counts_from_the_last_send() -> None:
    old = _situation(unknown_since=None, last_sent_at=NOW - timedelta(hours=1))
    assert old.overdue
    change = decide(old, Unavailable("503"))
    assert change.code == "to_review" and change.review == "lookup_unavailable"
    fresh = _situation(unknown_since=None, last_sent_at=NOW - timedelta(minutes=1))
    assert not fresh.overdue


def test_an_operation_known_only_by_its_first_send_counts_from_it() -> None:
    # facts without a last send (and without per-attempt records): the first send bounds it
    first = NOW - timedelta(minutes=5)
    only_first = _situation(first_sent_at=first, last_sent_at=None, sends=())
    assert only_first.quiet_at == first + TIMEOUT + landing_slack(FENCED)


def test_with_neither_it_is_not_overdue_before_the_deadline() -> None:
    # nothing dates it (no send, no unknown_since): "unknown for" starts now
    undated = _situation(unknown_since=None, last_sent_at=None, first_sent_at=None)
    assert not undated.overdue
    assert decide(undated, Unavailable("503")).code == "lookup_unavailable"
    assert replace(undated, deadline=NOW).overdue  # the deadline still makes it overdue


def test_it_is_overdue_from_the_very_moment_the_review_threshold_is_reached() -> None:
    at = _situation(unknown_since=NOW - timedelta(minutes=10))  # review_after: 10 minutes
    assert at.overdue
    assert not replace(at, unknown_since=NOW - timedelta(minutes=10) + timedelta(seconds=1)).overdue


def test_a_resend_is_allowed_again_once_the_clock_step_is_trusted() -> None:
    stepped = _situation(resend=True, clock_doubt_until=NOW - timedelta(minutes=5))
    assert stepped.clock_trusted_at is not None and stepped.asked >= stepped.clock_trusted_at
    assert stepped.may_resend
    doubting = replace(stepped, clock_doubt_until=NOW)
    assert not doubting.may_resend  # still inside the step's doubt (and its landing slack)


def test_a_resend_is_allowed_from_the_very_moment_the_clock_is_trusted_again() -> None:
    at = _situation(resend=True, clock_doubt_until=NOW - landing_slack(FENCED))
    assert at.clock_trusted_at == NOW == at.asked
    assert at.may_resend


def test_a_receipt_of_success_settles_at_once_even_with_sends_still_in_flight() -> None:
    # two attempts, the second still on the wire: "done" needs no wait (the key makes any
    # late request a replay); only "not done" waits for quiescence
    in_flight = _situation(
        last_sent_at=NOW - timedelta(seconds=1),
        sends=((NOW - timedelta(minutes=5), NOW - timedelta(minutes=4)), (NOW, None)),
        lease_ends=(NOW - timedelta(minutes=4), NOW + timedelta(minutes=1)),
    )
    assert in_flight.asked < in_flight.quiet_at
    found = Found(Receipt("re_1", "succeeded", {"amount_minor": 1}))
    assert decide(in_flight, found).code == "found"
