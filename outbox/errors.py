"""Exceptions raised by Settled.

Expected outcomes (a decline, an unknown result) are values, not exceptions. These are for
misuse, bad input and broken invariants::

    SettledError
    ├── InvalidInput            bad input: nothing was written (code names what was wrong)
    │   ├── InvalidIdentifier   tenant or op_id fails the allow-list
    │   ├── UnknownKind         no operation kind of that name is registered
    │   ├── InvalidParams       params fail the kind's intent model
    │   └── InvalidSetting      the configuration is refused: nothing was started, written
    │       │                   or sent (``setting`` names the variable)
    │       └── FenceNotVerified  a kind's contract declares a deadline fence its downstream
    │                           did not show when probed (``kinds``, ``urls``)
    ├── IdempotencyConflict     same (tenant, op_id) already holds another intent
    ├── IllegalTransition       the state machine forbids this event in this state
    ├── StaleLease              a write whose fencing version is no longer current
    ├── NotFound                no such operation / run / review item for this tenant
    ├── Forbidden               the staff role may not take this action
    ├── ReviewConflict          a review item was resolved by somebody else first, or the
    │                           resolution contradicts the downstream's evidence
    └── ProposalConflict        an agent's proposal was decided by somebody else first

Every class carries a stable ``code``; the class docstring is the default message. Messages
never contain intent parameters, payees or secrets.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SettledError(Exception):
    """Settled error."""

    code: ClassVar[str] = "settled_error"

    def __init__(self, message: str | None = None, *, code: str | None = None, **data: Any):
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        if code is not None:
            self.code = code  # type: ignore[misc]  # a finer code than the class's own
        self.data = data
        super().__init__(self.message)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-safe description: code, message and the error's safe attributes."""
        return {"code": self.code, "message": self.message, **self.data}


class InvalidInput(SettledError):
    """Invalid input; nothing was written."""

    code = "invalid_input"


class InvalidIdentifier(InvalidInput):
    """Invalid tenant or operation identifier."""

    code = "invalid_identifier"


class UnknownKind(InvalidInput):
    """Unknown operation kind."""

    code = "unknown_kind"


class InvalidParams(InvalidInput):
    """The operation parameters do not match the kind's intent model."""

    code = "invalid_params"


class InvalidSetting(InvalidInput):
    """The configuration is refused; nothing was started, written or sent."""

    code = "invalid_setting"


class FenceNotVerified(InvalidSetting):
    """A declared deadline fence was not verified: the downstream did not refuse the probe
    with 408 deadline_exceeded; nothing was started, written or sent."""

    code = "fence_not_verified"


class IdempotencyConflict(SettledError):
    """This (tenant, op_id) already names a different intent; the stored one is untouched."""

    code = "idempotency_conflict"


class IllegalTransition(SettledError):
    """This event is not allowed in the operation's current state."""

    code = "illegal_transition"


class StaleLease(SettledError):
    """The lease was taken over by a newer claim; this write was refused."""

    code = "stale_lease"


class NotFound(SettledError):
    """Not found."""

    code = "not_found"


class Forbidden(SettledError):
    """This role may not take this action."""

    code = "forbidden"


class ReviewConflict(SettledError):
    """The review item cannot be resolved that way."""

    code = "review_conflict"


class ProposalConflict(SettledError):
    """The proposal was already decided; nothing was written."""

    code = "proposal_decided"
