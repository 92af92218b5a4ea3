"""The rules of agents' proposals, pure (no database): what a repeat is, what else is on an
order, when a tenant's policy approves by itself, and whether a proposal may be decided.

``outbox.proposals`` applies them under the order's lock; the approvals model checks them
(``python -m tests.model``). They read proposals and operations through the small protocols
below, so a ``Proposal`` row and a model's value both do.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from outbox.proposal_states import EVENT_TO, LIVE, TRANSITIONS, ProposalStatus
from outbox.states import State

HANDLE_PREFIX = "prp_"
HANDLE_RE = re.compile(r"prp_[A-Za-z0-9_-]{32}")
MAX_REASON = 500
MAX_ACTOR = 100
PROPOSED, APPROVED = ProposalStatus.PROPOSED, ProposalStatus.APPROVED
DECLINED, EXPIRED = ProposalStatus.DECLINED, ProposalStatus.EXPIRED
#: an operation in one of these states has nothing to offset yet, or never will have
NOTHING_DONE = frozenset({State.PLANNED.value, State.REJECTED.value, State.CANCELLED.value})
#: a compensation in one of these states undid nothing: another may be approved after it
UNDID_NOTHING = frozenset({State.REJECTED.value, State.CANCELLED.value})


def new_handle() -> str:
    """An opaque, unguessable proposal handle (192 random bits)."""
    return HANDLE_PREFIX + secrets.token_urlsafe(24)


def without(params: Mapping[str, Any], field: str | None) -> dict[str, Any]:
    """``params`` less ``field`` (all of them when None)."""
    return {k: v for k, v in params.items() if k != field}


class _Standing(Protocol):
    """What the rules read of a proposal on the order (a ``Proposal`` row, or a model's)."""

    @property
    def status(self) -> str: ...

    @property
    def op_id(self) -> str | None: ...


class _Done(Protocol):
    """What the rules read of an operation on the order (an ``Operation`` row, or a model's)."""

    @property
    def kind(self) -> str: ...

    @property
    def op_id(self) -> str: ...

    @property
    def state(self) -> str: ...


ProposalT = TypeVar("ProposalT", bound=_Standing)
OperationT = TypeVar("OperationT", bound=_Done)


def repeat_of(
    earlier: Sequence[ProposalT], same_params: Callable[[ProposalT], bool]
) -> ProposalT | None:
    """The earliest live proposal among ``earlier`` with the same parameters (None: none)."""
    for proposal in earlier:
        if proposal.status in LIVE and same_params(proposal):
            return proposal
    return None


def on_the_order(
    ever: Sequence[ProposalT],
    operations: Sequence[OperationT],
    kind: str,
    repeated: ProposalT | None = None,
) -> tuple[tuple[ProposalT, ...], tuple[OperationT, ...]]:
    """What else of ``kind`` is on an order, as a new request (or ``repeated``, the one it
    repeats) sees it: the live proposals among ``ever`` (every proposal on the order, however
    old) other than ``repeated``, and the operations of the kind that no proposal made (the
    app's own) and that were not rejected or cancelled. What an approval shows, and what keeps
    the policy from approving by itself (``auto_approvable``)."""
    live = tuple(p for p in ever if p.status in LIVE and p is not repeated)
    proposed_ops = {p.op_id for p in ever if p.op_id is not None}
    others = tuple(
        op
        for op in operations
        if op.kind == kind and op.op_id not in proposed_ops and op.state not in UNDID_NOTHING
    )
    return live, others


def auto_approvable(
    limit: int | None,
    amount: int | None,
    earlier: Sequence[_Standing],
    others: Sequence[_Done] = (),
) -> bool:
    """Whether a tenant's policy approves a new proposal by itself: an amount at most the
    tenant's limit, no other live proposal for the same order, however old, and no operation
    of the kind on it that the app made itself and that did something or may (a second refund
    on one order always needs a person's explicit approval, which shows the first)."""
    if limit is None or amount is None or amount > limit:
        return False
    return not any(p.status in LIVE for p in earlier) and not others


def decision_check(status: str, expired: bool, to: str) -> str | None:
    """Whether a proposal in ``status`` (``expired``: past its time to live, marked or not)
    may be decided ``to`` (APPROVED or DECLINED): None to go on; ``to`` when it already is
    (answered unchanged); else the refusal's code (``proposal_expired``, ``proposal_decided``:
    the transition table has no such move). The conditional UPDATE re-checks status and age
    under the row's lock (``outbox.storage.proposals.decide``)."""
    if status == to:
        return to
    if expired:
        return "proposal_expired"
    if (status, EVENT_TO[ProposalStatus(to)]) not in TRANSITIONS:
        return "proposal_decided"
    return None
