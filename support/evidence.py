"""What the downstream's own record lets support staff write: a pure function.

A staff resolution is weighed against a lookup made just before it (none where the kind's
downstream has no lookup API). The lookup either settles what is stored, or contradicts the
resolution, or cannot tell; only then may a supervisor override, and what they write is
their statement, recorded as such.

==========================================  ==========================  =======================
what the lookup says                        resolve "succeeded"         resolve "rejected"
==========================================  ==========================  =======================
no lookup API                               staff statement             staff statement
found, succeeded                            its receipt (same ref)      contradicted
found, rejected                             contradicted                its record
its record, other params (mismatch)         its record, marked as       its record, if a
                                            differing (same ref)        refusal
not found, proven (quiet, key retained)     contradicted                proven: not executed
not found, unproven                         override: statement         override: statement
unavailable                                 override: statement         override: statement
taken on, not finished (pending)            refused                     refused
a record not ours or not storable           override: statement         override: statement
==========================================  ==========================  =======================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.downstream import (
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Receipt,
    Settlement,
    Unavailable,
    lookup_name,
    settlement,
)
from outbox.errors import ReviewConflict
from outbox.states import State

#: Why no resolution can be stored while the downstream holds the operation unfinished.
PENDING = (
    "the downstream has taken this on and not finished it (pending): it may still succeed or "
    "fail, so nothing can be resolved, not even by an override; requery once it has settled"
)

#: Why a lookup cannot settle a resolution yet, as staff read it.
UNPROVEN = {
    "not_quiet": (
        "the downstream has no record yet, but a send may still be landing: a 'not found' "
        "proves nothing until the operation is quiet; ask again later"
    ),
    "clock_step": (
        "the database's clock was stepped (set, not slewed) a moment ago, so a send may still "
        "be landing although its lease looks over: a 'not found' proves nothing until every "
        "send in flight at the step is over; ask again shortly"
    ),
    "past_key_retention": (
        "the downstream may have forgotten this key (past its retention): a 'not found' "
        "proves nothing; a supervisor may override with a justification"
    ),
    "lookup_unavailable": (
        "the downstream's lookup is unavailable; it must confirm first: try again later, or a "
        "supervisor may override with a justification"
    ),
    "unusable_record": (
        "the downstream answered with a record that is not this operation's or cannot be "
        "stored; a supervisor may override with a justification after checking with it"
    ),
}


@dataclass(frozen=True)
class Weighed:
    """What a resolution may store."""

    #: the downstream's record to store; None: the staff's own statement
    record: dict[str, Any] | None
    #: why the lookup could not confirm it, where a supervisor's override accepted it
    unproven: str | None = None
    #: what the downstream's record settles the operation as (its state and reason);
    #: None where no record of the downstream's is stored
    settles: Settlement | None = None


def weigh(
    lookup: LookupOutcome | None,
    to: State,
    reference: str | None,
    *,
    doubt: str | None = None,
    override: bool = False,
) -> Weighed:
    """What resolving as ``to`` may store, given ``lookup``; ReviewConflict when refused.

    ``doubt`` is why the lookup's "not found" cannot prove that nothing ran
    (``reconciler.decide.not_found_doubt``); ``override`` is a supervisor's explicit choice,
    checked by the caller.
    """
    if lookup is None:
        return Weighed(None)  # no lookup API: the staff's evidence is all there is
    if isinstance(lookup, Unavailable) and lookup.pending:
        # Taken on and not finished: whatever staff wrote could be undone by the downstream
        # (a "rejected" here, a new refund by the app, and then this one completes).
        raise ReviewConflict(PENDING, code="downstream_pending", why="downstream_pending")
    if isinstance(lookup, Found):
        return Weighed(_agreeing(lookup.receipt, to, reference, lookup), settles=settlement(lookup))
    if isinstance(lookup, LookupMisuse) and lookup.record is not None:
        record = _agreeing(lookup.record, to, reference, lookup)
        return Weighed(
            {**record, "differs_from_intent": True, "mismatch": lookup.code},
            settles=settlement(Found(lookup.record)),  # what the downstream did, as found
        )
    if isinstance(lookup, LookupNotFound) and doubt is None:
        if to is State.REJECTED:
            return Weighed(None)  # proven: nothing was executed
        raise _contradiction(lookup, to)
    unproven = "lookup_unavailable"
    if isinstance(lookup, LookupMisuse):
        unproven = "unusable_record"
    elif isinstance(lookup, LookupNotFound) and doubt is not None:
        unproven = doubt
    if not override:
        code = "not_found_unproven" if isinstance(lookup, LookupNotFound) else unproven
        raise ReviewConflict(UNPROVEN[unproven], code=code, why=unproven)
    return Weighed(None, unproven)


def _agreeing(
    record: Receipt, to: State, reference: str | None, lookup: LookupOutcome
) -> dict[str, Any]:
    """The downstream's record, if it says what the resolution says."""
    if to is State.SUCCEEDED:
        agrees = record.status == "succeeded" and record.reference == reference
    else:
        agrees = record.status != "succeeded"
    if not agrees:
        raise _contradiction(lookup, to)
    return record.as_dict()


def _contradiction(lookup: LookupOutcome, to: State) -> ReviewConflict:
    return ReviewConflict(
        f"the downstream's lookup ({lookup_name(lookup)}) contradicts '{to.value}'",
        code="contradicts_downstream",
        lookup=lookup_name(lookup),
    )


@dataclass(frozen=True)
class Choice:
    """One way a resolution may be offered to staff: the outcome, and whether it is only
    possible as a supervisor's override (their statement, with a justification)."""

    outcome: str  # "succeeded" or "rejected"
    override: bool = False


def allowed_choices(
    lookup: str | None, record_status: str | None = None, *, may_override: bool
) -> tuple[Choice, ...]:
    """The resolutions the downstream's last answer allows, as ``weigh`` would judge them.

    ``lookup`` is the last lookup's name (``lookup_name``: "none" where the downstream has no
    lookup API, None where none was asked yet), ``record_status`` the status of the record it
    found. The resolve still weighs a fresh lookup: this only keeps the page from offering
    what would be refused. A "not found" offers "rejected" (refused if it is not yet quiet)
    and, to a supervisor, either outcome as an override.
    """
    plain = (Choice("succeeded"), Choice("rejected"))
    overrides = (Choice("succeeded", True), Choice("rejected", True)) if may_override else ()
    if lookup == "none":
        return plain  # no lookup API: the staff's evidence is all there is
    if lookup in ("found", "mismatch") and record_status is not None:
        return (Choice("succeeded"),) if record_status == "succeeded" else (Choice("rejected"),)
    if lookup == "mismatch":
        return (*plain, *overrides)  # as its record says, if it can be stored
    if lookup == "not_found":
        return (Choice("rejected"), *overrides)
    if lookup == "pending":
        return ()  # the downstream has not finished it: requery later
    return overrides  # unavailable, or not asked yet
