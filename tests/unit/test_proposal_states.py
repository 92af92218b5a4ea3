from __future__ import annotations

import itertools

import pytest

from outbox.errors import IllegalTransition
from outbox.models import PROPOSAL_STATUSES
from outbox.proposal_states import (
    DECIDED,
    LIVE,
    TRANSITIONS,
    ProposalEvent,
    ProposalStatus,
    proposal_transition,
)
from outbox.proposals import APPROVED, DECLINED, EXPIRED, PROPOSED, decision_check

P, OK, NO, X = "proposed", "approved", "declined", "expired"

# The expected table, written out independently of TRANSITIONS: (status, event) -> status.
EXPECTED = {
    (P, ProposalEvent.APPROVE): OK,
    (P, ProposalEvent.DECLINE): NO,
    (P, ProposalEvent.EXPIRE): X,
}


@pytest.mark.parametrize(
    ("status", "event"), list(itertools.product(ProposalStatus, ProposalEvent))
)
def test_every_status_event_is_allowed_exactly_when_the_table_says(
    status: ProposalStatus, event: ProposalEvent
) -> None:
    expected = EXPECTED.get((status.value, event))
    if expected is not None:
        assert proposal_transition(status, event) == expected
        # stored values are plain strings: a row's status is read back as one
        assert proposal_transition(status.value, event) == expected
    else:
        with pytest.raises(IllegalTransition):
            proposal_transition(status, event)


def test_table_matches_the_expected_table() -> None:
    assert {(s.value, e): t.value for (s, e), t in TRANSITIONS.items()} == EXPECTED


def test_stored_values_are_unchanged() -> None:
    # the column's check constraint (migration 0006) names exactly these values
    assert {s.value for s in ProposalStatus} == {P, OK, NO, X}
    assert ",".join(f"'{s}'" for s in ProposalStatus) == PROPOSAL_STATUSES
    assert (PROPOSED, APPROVED, DECLINED, EXPIRED) == (P, OK, NO, X)


def test_decided_statuses_never_change() -> None:
    assert {ProposalStatus.APPROVED, ProposalStatus.DECLINED, ProposalStatus.EXPIRED} == DECIDED
    assert all(s.decided for s in DECIDED) and not ProposalStatus.PROPOSED.decided


def test_live_statuses_are_the_ones_a_repeat_answers_from() -> None:
    assert {P, OK} == LIVE


@pytest.mark.parametrize("status", list(ProposalStatus))
@pytest.mark.parametrize("to", [ProposalStatus.APPROVED, ProposalStatus.DECLINED])
@pytest.mark.parametrize("expired", [False, True])
def test_decision_check_follows_the_table(
    status: ProposalStatus, to: ProposalStatus, expired: bool
) -> None:
    got = decision_check(status.value, expired, to)
    if status is to:
        assert got == to  # answered unchanged
    elif expired:
        assert got == "proposal_expired"
    elif status is ProposalStatus.PROPOSED:
        assert got is None
    else:
        assert got == "proposal_decided"
