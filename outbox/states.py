"""The operation state machine of DESIGN.md, as one explicit transition table."""

from __future__ import annotations

import enum

from outbox.errors import IllegalTransition


class State(enum.StrEnum):
    PLANNED = "planned"
    SUBMITTED = "submitted"
    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({State.SUCCEEDED, State.REJECTED, State.CANCELLED})
#: States an automatic path may still move (the "live" part of the table).
LIVE = frozenset({State.PLANNED, State.SUBMITTED, State.UNKNOWN})


class RejectReason(enum.StrEnum):
    BUSINESS_REJECTED = "business_rejected"
    INVALID_PARAMS = "invalid_params"
    PERMISSION_DENIED = "permission_denied"
    NOT_EXECUTED = "not_executed"


class ConfigFault(enum.StrEnum):
    """A stop that Settled's own configuration caused, not the customer nor the downstream:
    the reason of the event row that stops the operation (its reject reason stays one of
    ``RejectReason``). Logged at ERROR naming the operation, counted
    (``settled_configuration_stops_total``) and alerted on (``deploy/prometheus``)."""

    #: the downstream refused our credentials for the tenant (401, 403, no API key configured):
    #: rejected ``permission_denied``, nothing executed, never retried
    CREDENTIALS_REFUSED = "credentials_refused"
    #: the stored intent does not match its fingerprint under the worker's key (the app's key
    #: differs, or the row was altered): rejected ``not_executed``, nothing sent, and a review
    #: item for staff
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"


class Event(enum.StrEnum):
    CLAIM = "claim"  # a worker takes a planned operation to send it
    ACCEPT = "accept"  # the downstream accepted: receipt matches the intent
    REFUSE = "refuse"  # a definite refusal (business, invalid params, permission)
    LOSE = "lose"  # no answer or an ambiguous one: the send may have happened
    DEFER = "defer"  # provably not sent / not executed: try again later, same key
    GIVE_UP = "give_up"  # budget spent while nothing ever reached the downstream
    CANCEL = "cancel"  # nothing was sent yet and the run or caller cancelled
    ABANDON = "abandon"  # a submitted operation whose lease expired: outcome unknown
    FIND = "find"  # a lookup found the business outcome (to succeeded or rejected)
    REQUEUE = "requeue"  # lookup proved "not found" after quiescence: send again, same key
    #: a "not found" not yet trustworthy (or no lookup), an idempotent downstream, the key
    #: live: sent again at once with the same key (a replay or the one execution)
    RESEND = "resend"
    RESOLVE = "resolve"  # support staff settled it with evidence


_P, _S, _U = State.PLANNED, State.SUBMITTED, State.UNKNOWN
_OK, _NO, _X = State.SUCCEEDED, State.REJECTED, State.CANCELLED

#: (state, event) -> the states the event may lead to. Anything absent is illegal.
TRANSITIONS: dict[tuple[State, Event], frozenset[State]] = {
    (_P, Event.CLAIM): frozenset({_S}),
    (_P, Event.CANCEL): frozenset({_X}),
    (_P, Event.GIVE_UP): frozenset({_NO}),
    (_S, Event.ACCEPT): frozenset({_OK}),
    (_S, Event.REFUSE): frozenset({_NO}),
    (_S, Event.LOSE): frozenset({_U}),
    (_S, Event.DEFER): frozenset({_P}),
    (_S, Event.GIVE_UP): frozenset({_NO}),
    (_S, Event.ABANDON): frozenset({_U}),
    (_S, Event.FIND): frozenset({_OK, _NO}),
    (_U, Event.FIND): frozenset({_OK, _NO}),
    (_U, Event.REQUEUE): frozenset({_P}),
    (_U, Event.RESEND): frozenset({_S}),
    (_U, Event.RESOLVE): frozenset({_OK, _NO}),
}


def transition(
    state: State, event: Event, to: State | None = None, reason: RejectReason | None = None
) -> State:
    """The state after ``event``; raise IllegalTransition where the table forbids it.

    ``to`` picks the target where an event has two (FIND, RESOLVE). A move to ``rejected``
    must carry a reason, and only such a move may.
    """
    targets = TRANSITIONS.get((state, event))
    if targets is None:
        raise IllegalTransition(
            f"event {event.value!r} is not allowed in state {state.value!r}",
            state=state.value,
            event=event.value,
        )
    if to is None:
        if len(targets) != 1:
            raise IllegalTransition(
                f"event {event.value!r} needs an explicit target", event=event.value
            )
        (to,) = targets
    if to not in targets:
        raise IllegalTransition(
            f"event {event.value!r} cannot lead from {state.value!r} to {to.value!r}",
            state=state.value,
            event=event.value,
            to=to.value,
        )
    if (to is State.REJECTED) != (reason is not None):
        raise IllegalTransition(
            "a move to 'rejected' needs a reason, and only such a move takes one",
            state=state.value,
            event=event.value,
        )
    return to
