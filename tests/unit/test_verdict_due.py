"""When an uncertain operation is decided at the latest: a table, and the bound checked against
the reconcile decision itself (looks simulated with every answer a lookup may give)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.downstream import Found, LookupNotFound, LookupOutcome, Receipt, Unavailable
from outbox.kinds import DownstreamContract
from outbox.states import State
from outbox.verdict_due import (
    MAX_RECHECK,
    Cadence,
    Uncertain,
    VerdictDue,
    WaitsFor,
    verdict_due,
)
from reconciler.decide import MAX_RECHECK as DECIDE_CAP
from reconciler.decide import Situation, decide

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
S = timedelta(seconds=1)
CADENCE = Cadence(
    review_after=600 * S,
    client_timeout=10 * S,
    reconcile_every=10 * S,
    contracts={},
)
LATE = 20 * S  # a beat period and a lookup's time (10 s each)
FENCED = DownstreamContract(enforces_deadline=True)  # processing 2 s
UNFENCED = DownstreamContract()  # delay bound 5 min, processing 2 s
NOT_IDEMPOTENT = DownstreamContract(idempotent=False)
NO_LOOKUP = DownstreamContract(queryable=False)


def uncertain(
    contract: DownstreamContract,
    *,
    sent_ago: int = 30,
    next_look_in: int = 0,
    deadline_in: int = 3600,
    state: State = State.UNKNOWN,
    in_review: bool = False,
    lease_in: int | None = None,
    clock_doubt_in: int | None = None,
) -> Uncertain:
    """An operation sent once ``sent_ago`` seconds ago, its outcome written 10 s later under
    a lease of 15 s, unknown since then."""
    start = NOW - sent_ago * S
    return Uncertain(
        state=state,
        contract=contract,
        now=NOW,
        deadline=NOW + deadline_in * S,
        next_look_at=NOW + next_look_in * S,
        in_review=in_review,
        unknown_since=None if state is State.SUBMITTED else start + 10 * S,
        last_sent_at=start,
        lease_until=None if lease_in is None else NOW + lease_in * S,
        sends=((start, start + 10 * S),),
        lease_ends=(start + 15 * S,),
        clock_doubt_until=None if clock_doubt_in is None else NOW + clock_doubt_in * S,
    )


CASES: dict[str, tuple[Uncertain, WaitsFor, datetime | None]] = {
    # fenced, quiet since the lease's end + 2 s: a lookup answer decides; while lookups are
    # unavailable it is looked at until the review threshold, then once more at most 5 min on
    "fenced_quiet": (
        uncertain(FENCED),
        WaitsFor.LOOKUP,
        NOW - 20 * S + 600 * S + MAX_RECHECK + LATE,
    ),
    # fenced, sent 10 s ago: its lease ends in 5 s, quiet 2 s later; but
    # the review threshold (10 min from unknown) is later, then a look every 5 min at most
    "fenced_not_quiet": (
        uncertain(FENCED, sent_ago=10),
        WaitsFor.QUIESCENCE,
        NOW + 600 * S + MAX_RECHECK + LATE,
    ),
    # unfenced: quiet 5 min + 2 s after the outcome was written, before the review threshold
    "unfenced_waits_out_the_delay_bound": (
        uncertain(UNFENCED),
        WaitsFor.QUIESCENCE,
        NOW - 20 * S + 600 * S + MAX_RECHECK + LATE,
    ),
    # unfenced, looked at again exactly at quiescence, itself past the review threshold
    "unfenced_look_at_quiescence": (
        uncertain(UNFENCED, next_look_in=282, deadline_in=200),
        WaitsFor.QUIESCENCE,
        NOW + 282 * S + LATE,
    ),
    # lookups unavailable, backing off: overdue at the review threshold, then one more look
    "lookups_unavailable": (
        uncertain(FENCED, sent_ago=400, next_look_in=120),
        WaitsFor.LOOKUP,
        NOW - 390 * S + 600 * S + MAX_RECHECK + LATE,
    ),
    # the next look is already past everything: it decides
    "next_look_after_all": (
        uncertain(FENCED, sent_ago=400, next_look_in=300),
        WaitsFor.LOOKUP,
        NOW + 300 * S + LATE,
    ),
    # past its deadline it is overdue: quiet too, so the next look decides
    "past_deadline": (uncertain(FENCED, deadline_in=-1), WaitsFor.LOOKUP, NOW + LATE),
    # past its deadline but not quiet: a "not found" waits for quiescence all the same
    "past_deadline_not_quiet": (
        uncertain(UNFENCED, deadline_in=-1, next_look_in=1),
        WaitsFor.QUIESCENCE,
        NOW + 282 * S + MAX_RECHECK + LATE,
    ),
    # a clock step: no "not found" trusted before its doubt ends and what it sent lands
    "clock_step": (
        uncertain(FENCED, sent_ago=700, clock_doubt_in=60),
        WaitsFor.CLOCK_STEP,
        NOW + 62 * S + MAX_RECHECK + LATE,
    ),
    "no_lookup_api": (uncertain(NO_LOOKUP, next_look_in=3), WaitsFor.REVIEW, NOW + 23 * S),
    "not_idempotent": (uncertain(NOT_IDEMPOTENT), WaitsFor.REVIEW, NOW + LATE),
    "in_review": (uncertain(FENCED, in_review=True), WaitsFor.STAFF, None),
    "in_review_unfenced": (uncertain(UNFENCED, in_review=True), WaitsFor.STAFF, None),
    # a send in flight, its lease ending in 10 s: unknown by then + late at the latest, then
    # as an unknown one (fenced: quiet already; the review threshold from then)
    "submitted": (
        uncertain(FENCED, state=State.SUBMITTED, lease_in=10, sent_ago=5),
        WaitsFor.SEND,
        NOW + 30 * S + 600 * S + MAX_RECHECK + LATE,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_due_table(name: str) -> None:
    op, waits_for, by = CASES[name]
    assert verdict_due(op, CADENCE) == VerdictDue(waits_for, by)


def test_reconciler_uses_the_same_cap() -> None:
    assert DECIDE_CAP is MAX_RECHECK


def test_bound_is_rounded_up_to_the_second() -> None:
    op = uncertain(NOT_IDEMPOTENT)
    op = Uncertain(**{**op.__dict__, "next_look_at": NOW + timedelta(milliseconds=1)})
    assert verdict_due(op, CADENCE).by == NOW + LATE + S


def test_evidence_carries_the_code_and_the_iso_time() -> None:
    assert VerdictDue(WaitsFor.LOOKUP, NOW).as_evidence() == {
        "waits_for": "lookup",
        "verdict_by": "2026-11-29T12:00:00+00:00",
    }
    assert VerdictDue(WaitsFor.STAFF, None).as_evidence() == {
        "waits_for": "staff",
        "verdict_by": None,
    }


#: what a look of the reconciler decides, beyond waiting (a code of ``decide``)
WAITING = {"wait_quiescence", "wait_clock_step", "lookup_unavailable"}
ANSWERS: dict[str, LookupOutcome] = {
    "not_found": LookupNotFound(),
    "unavailable": Unavailable("503"),
    "found": Found(Receipt("re_1", "succeeded", {})),
}


@settings(max_examples=300, deadline=None)
@given(
    contract=st.sampled_from([FENCED, UNFENCED, NOT_IDEMPOTENT, NO_LOOKUP]),
    sent_ago=st.integers(0, 2000),
    next_look_in=st.integers(-30, 400),
    deadline_in=st.integers(-100, 3000),
    lookups=st.integers(0, 20),
    doubt_in=st.one_of(st.none(), st.integers(-100, 300)),
    answers=st.lists(st.sampled_from(["not_found", "unavailable", "found"]), min_size=60),
    lateness=st.lists(st.integers(0, 20), min_size=60),
)
def test_reconciler_decides_by_the_bound(
    contract: DownstreamContract,
    sent_ago: int,
    next_look_in: int,
    deadline_in: int,
    lookups: int,
    doubt_in: int | None,
    answers: list[str],
    lateness: list[int],
) -> None:
    """Looks as the reconciler makes them, each up to a beat period and a lookup late, each
    answered as the lookup pleases: the decision comes by the promised time."""
    op = uncertain(
        contract,
        sent_ago=sent_ago,
        next_look_in=next_look_in,
        deadline_in=deadline_in,
        clock_doubt_in=doubt_in,
    )
    due = verdict_due(op, CADENCE)
    assert due.by is not None
    due_at = max(op.next_look_at, NOW)
    for answer, late in zip(answers, lateness, strict=False):
        at = due_at + late * S
        situation = Situation(
            state=State.UNKNOWN,
            contract=contract,
            now=at,
            deadline=op.deadline,
            first_sent_at=op.last_sent_at,
            last_sent_at=op.last_sent_at,
            unknown_since=op.unknown_since,
            lookups=lookups,
            client_timeout=CADENCE.client_timeout,
            review_after=CADENCE.review_after,
            in_review=False,
            asked_at=at,
            sends=op.sends,
            lease_ends=op.lease_ends,
            clock_doubt_until=op.clock_doubt_until,
        )
        lookup = ANSWERS[answer] if contract.queryable else None
        change = decide(situation, lookup)
        if change.code not in WAITING:
            assert at <= due.by, (change.code, at, due)
            return
        assert at <= due.by
        assert change.next_attempt_at is not None
        due_at = change.next_attempt_at
        lookups += 1
    pytest.fail(f"not decided within {len(answers)} looks: {due}")
