from __future__ import annotations

import itertools

import pytest

from outbox.errors import IllegalTransition
from outbox.states import TERMINAL, TRANSITIONS, Event, RejectReason, State, transition

P, S, U = State.PLANNED, State.SUBMITTED, State.UNKNOWN
OK, NO, X = State.SUCCEEDED, State.REJECTED, State.CANCELLED

# The expected table, written out independently of TRANSITIONS: (state, event) -> targets.
EXPECTED = {
    (P, Event.CLAIM): {S},
    (P, Event.CANCEL): {X},
    (P, Event.GIVE_UP): {NO},
    (S, Event.ACCEPT): {OK},
    (S, Event.REFUSE): {NO},
    (S, Event.LOSE): {U},
    (S, Event.DEFER): {P},
    (S, Event.GIVE_UP): {NO},
    (S, Event.ABANDON): {U},
    (S, Event.FIND): {OK, NO},
    (U, Event.FIND): {OK, NO},
    (U, Event.REQUEUE): {P},
    (U, Event.RESEND): {S},
    (U, Event.RESOLVE): {OK, NO},
}


@pytest.mark.parametrize(("state", "event", "to"), list(itertools.product(State, Event, State)))
def test_every_state_event_target_is_allowed_exactly_when_the_design_says(
    state: State, event: Event, to: State
) -> None:
    reason = RejectReason.BUSINESS_REJECTED if to is NO else None
    if to in EXPECTED.get((state, event), set()):
        assert transition(state, event, to, reason) is to
    else:
        with pytest.raises(IllegalTransition):
            transition(state, event, to, reason)


def test_table_matches_the_design_table() -> None:
    assert {k: set(v) for k, v in TRANSITIONS.items()} == EXPECTED


@pytest.mark.parametrize("state", sorted(TERMINAL))
@pytest.mark.parametrize("event", list(Event))
def test_terminal_states_never_change(state: State, event: Event) -> None:
    assert state.terminal
    with pytest.raises(IllegalTransition):
        transition(state, event, None, None)


def test_live_states_are_not_terminal() -> None:
    assert not any(s.terminal for s in (P, S, U))


def test_rejected_without_reason_is_illegal() -> None:
    with pytest.raises(IllegalTransition, match="reason"):
        transition(S, Event.REFUSE)


def test_reason_on_a_move_not_to_rejected_is_illegal() -> None:
    with pytest.raises(IllegalTransition, match="reason"):
        transition(S, Event.ACCEPT, reason=RejectReason.BUSINESS_REJECTED)


def test_event_with_two_targets_needs_an_explicit_one() -> None:
    with pytest.raises(IllegalTransition, match="explicit target"):
        transition(U, Event.FIND)


def test_single_target_event_defaults_to_it() -> None:
    assert transition(S, Event.LOSE) is U
    assert transition(S, Event.REFUSE, reason=RejectReason.PERMISSION_DENIED) is NO
