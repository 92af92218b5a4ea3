"""The pure builders of the services' decision inputs (which the model checker calls too):
the send bound, an attempt's time on the wire, the facts and the reconciler's situation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from outbox.kinds import DownstreamContract
from outbox.states import State
from outbox.storage.attempts import facts_of, on_wire_until
from reconciler.decide import situation_of
from workers.sending import send_bound

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
S = timedelta(seconds=1)


def test_the_send_bound_is_the_lease_end_less_the_clock_margin_or_the_deadline() -> None:
    assert send_bound(T0 + 15 * S, T0 + 60 * S, 1.0) == T0 + 14 * S
    assert send_bound(T0 + 15 * S, T0 + 60 * S, 0.25) == T0 + 15 * S - S / 4
    assert send_bound(T0 + 15 * S, T0 + 10 * S, 1.0) == T0 + 10 * S  # the deadline first


def test_an_attempt_is_on_the_wire_until_its_outcome_but_never_past_its_lease() -> None:
    assert on_wire_until(T0 + 15 * S, T0 + 3 * S) == T0 + 3 * S
    assert on_wire_until(T0 + 15 * S, T0 + 40 * S) == T0 + 15 * S  # written late: the lease
    assert on_wire_until(T0 + 15 * S, None) == T0 + 15 * S  # still open
    assert on_wire_until(None, None) is None  # written before 0.2


def test_the_facts_carry_each_attempts_start_end_and_lease_end() -> None:
    times = [(T0, T0 + 15 * S, T0 + 40 * S), (T0 + 50 * S, T0 + 65 * S, None)]
    facts = facts_of(T0 + 20 * S, 2, True, times)
    assert facts.sends == ((T0, T0 + 15 * S), (T0 + 50 * S, T0 + 65 * S))
    assert facts.lease_ends == (T0 + 15 * S, T0 + 65 * S)
    assert facts.last_sent_at == T0 + 50 * S
    assert (facts.unknown_since, facts.lookups, facts.in_review) == (T0 + 20 * S, 2, True)


def test_the_situation_dates_a_not_found_by_the_claim_not_by_the_decision() -> None:
    facts = facts_of(None, 0, False, [(T0, T0 + 15 * S, None)])
    s = situation_of(
        state=State.UNKNOWN,
        contract=DownstreamContract(enforces_deadline=True),
        deadline=T0 + 3600 * S,
        first_sent_at=T0,
        claimed_at=T0 + 20 * S,
        facts=facts,
        now=T0 + 30 * S,
        client_timeout=10.0,
        review_after=600.0,
        clock_doubt_until=None,
        resend=True,
    )
    assert s.asked == T0 + 20 * S and s.now == T0 + 30 * S
    assert s.sends == facts.sends and s.lease_ends == facts.lease_ends
    assert (s.client_timeout, s.review_after) == (10 * S, 600 * S)
    assert s.resend and not s.in_review
