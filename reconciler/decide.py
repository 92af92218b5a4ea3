"""The reconcile decision: a pure function of the operation, its attempts, the lookup result,
the downstream contract and the time. No database, clock or network in here.

It only ever settles from evidence: a receipt found by a lookup settles; "not found" is
trusted only when the lookup was *asked* after quiescence (no request of any attempt can still
land, and what landed is visible), inside the key retention window less its margin, with an
idempotent downstream, and then only sends the operation back to ``planned`` with the *same*
key. Which assumption says that no request can still land is the contract's (``rests_on``):
the downstream's deadline fence, or the declared delay bound; the requeue records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from outbox.change import Change
from outbox.downstream import (
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Unavailable,
    lookup_name,
    mismatch_evidence,
    settlement,
)
from outbox.kinds import DownstreamContract
from outbox.quiescence import landing_slack, quiet_at
from outbox.states import Event, State
from outbox.verdict_due import MAX_RECHECK as MAX_RECHECK  # the backoff cap the answers use

if TYPE_CHECKING:
    from outbox.storage.attempts import OperationFacts


@dataclass(frozen=True)
class Situation:
    state: State  # UNKNOWN, or SUBMITTED with an expired lease (its worker died mid-send)
    contract: DownstreamContract
    now: datetime
    deadline: datetime
    first_sent_at: datetime | None
    last_sent_at: datetime | None  # start of the newest attempt
    unknown_since: datetime | None
    lookups: int  # lookups tried before this one
    client_timeout: timedelta
    review_after: timedelta
    in_review: bool
    #: database time read *before* the lookup was asked (None: ``now``); a "not found" is
    #: dated by it, never by when the answer came back
    asked_at: datetime | None = None
    #: per attempt: its start, and the latest it may have been on the wire
    #: (``outbox.storage.attempts.OperationFacts``)
    sends: tuple[tuple[datetime, datetime | None], ...] = ()
    #: per attempt, in the order of ``sends``: the end of the lease it was sent under
    #: (``attempts.not_after``; None for attempts written before 0.2)
    lease_ends: tuple[datetime | None, ...] = ()
    #: after a step of the database's clock, the latest a send in flight at the step may still
    #: be sent by its sender (``outbox.clock_steps``); None: no step is known
    clock_doubt_until: datetime | None = None
    #: the reconciler can hand a send to the executor (``Reconciler.resender``)
    resend: bool = False
    #: how far the downstream's clock was measured behind the database's at worst, recently
    #: (``outbox.clock_steps.ClockWatch.downstream_lag``; this lookup's own answer among the
    #: measurements); None: no answer said the downstream's time, its clock is assumed within
    #: ``clock_margin``
    downstream_lag: timedelta | None = None
    #: the clock margin the sender took off each ``Settled-Deadline``
    #: (``SETTLED_CLOCK_MARGIN_SECONDS``)
    clock_margin: timedelta = timedelta(0)

    @property
    def quiet_at(self) -> datetime:
        """When a "not found" becomes trustworthy: no request of any attempt can still land,
        and whatever landed is visible (``processing_time`` later). When the last request can
        land is what the contract says (``rests_on``):

        - ``enforces_deadline`` (``deadline_fence``): the downstream refuses a request that
          arrives after its ``Settled-Deadline`` D, by its own clock. The sender set D to at
          most its lease end less the clock margin (database time, ``Executor.send_deadline``),
          and the downstream's clock is within the clock margin of the database's, so a
          request it accepts arrived by database time D + margin, i.e. by the lease end.
          Each attempt counts from its lease end, even when its outcome was written earlier:
          its client gave up, but a proxy or the network may still hold the request.
          The downstream's clock is measured, not assumed: where its answers say its time and
          it was seen ``downstream_lag`` behind the database's, beyond the margin, the fence
          holds that much later (``lag_excess``): a "not found" is trusted only once the
          header's deadline has passed in the downstream's own clock, plus processing.
        - otherwise (``delay_bound``): only the declared bound stops a late request. Each
          attempt counts from the end its sender knew (its outcome written, or its lease's
          end) plus ``max_request_delay``.

        An attempt with neither bound (written before 0.2) counts from its start plus the
        client timeout."""
        return quiet_at(
            self.contract,
            sends=self.sends,
            lease_ends=self.lease_ends,
            client_timeout=self.client_timeout,
            last_sent_at=self.last_sent_at or self.first_sent_at,
            now=self.now,
            lag_excess=self.lag_excess,
        )

    @property
    def lag_excess(self) -> timedelta:
        """How much later than its lease's end the downstream's fence may accept a request:
        its measured lag beyond the clock margin (0 within it, or not measured)."""
        if self.downstream_lag is None:
            return timedelta(0)
        return max(timedelta(0), self.downstream_lag - self.clock_margin)

    @property
    def landing_slack(self) -> timedelta:
        """How long after its sender is done a request may still land and become visible
        (``outbox.quiescence.landing_slack``)."""
        return landing_slack(self.contract)

    @property
    def asked(self) -> datetime:
        return self.asked_at or self.now

    @property
    def past_retention(self) -> bool:
        """Past the key retention less its margin: nothing may be re-sent, and a "not found"
        may only mean the downstream forgot the key."""
        return self.first_sent_at is not None and self.now >= self.contract.resend_until(
            self.first_sent_at
        )

    @property
    def overdue(self) -> bool:
        """Unknown for longer than the review threshold, or past the operation's deadline."""
        since = self.unknown_since or self.last_sent_at or self.now
        return self.now >= self.deadline or self.now - since >= self.review_after

    @property
    def may_resend(self) -> bool:
        """Whether what a lookup cannot settle yet may be settled by sending the operation
        again with its key: the downstream is idempotent (a same-key, same-parameters request
        replays the first one's answer or executes once), the reconciler can hand a send to
        the executor, no person owns it (in review), and the database's clock has not just
        stepped (the key retention is reckoned on it). Whether the key is still live, the
        deadline ahead, the run not cancelled and the budget not spent is the executor's to
        check, as before every send (``workers.verdicts.check_before_send``)."""
        trusted = self.clock_trusted_at
        return (
            self.resend
            and self.contract.idempotent
            and not self.in_review
            and (trusted is None or self.asked >= trusted)
        )

    @property
    def clock_trusted_at(self) -> datetime | None:
        """After a step of the database's clock, when a "not found" can be trusted again:
        every send in flight at the step is over and what it did has landed and is visible
        (the slack ``quiet_at`` allows after a send's end)."""
        if self.clock_doubt_until is None:
            return None
        return self.clock_doubt_until + self.landing_slack


def situation_of(
    *,
    state: State,
    contract: DownstreamContract,
    deadline: datetime,
    first_sent_at: datetime | None,
    claimed_at: datetime,
    facts: OperationFacts,
    now: datetime,
    client_timeout: float,
    review_after: float,
    clock_doubt_until: datetime | None,
    resend: bool,
    downstream_lag: timedelta | None = None,
    clock_margin: timedelta = timedelta(0),
) -> Situation:
    """The situation the reconciler decides on, from its claim's values (``claimed_at``: the
    database time the claim read, before the lookup was asked), the operation's facts
    (``outbox.storage.attempts.operation_facts``), its settings (seconds), the clock watch's
    doubt, the downstream's measured lag with the clock margin it is weighed against
    (``outbox.downstream_clock``), and the database time read for the decision (``now``). One
    builder, which the
    service and the model checker (``tests/model``) both call: a "not found" is dated by the
    claim, never by ``now``."""
    return Situation(
        state=state,
        contract=contract,
        now=now,
        deadline=deadline,
        first_sent_at=first_sent_at,
        last_sent_at=facts.last_sent_at,
        unknown_since=facts.unknown_since,
        lookups=facts.lookups,
        client_timeout=timedelta(seconds=client_timeout),
        review_after=timedelta(seconds=review_after),
        in_review=facts.in_review,
        asked_at=claimed_at,
        sends=facts.sends,
        lease_ends=facts.lease_ends,
        clock_doubt_until=clock_doubt_until,
        resend=resend,
        downstream_lag=downstream_lag,
        clock_margin=clock_margin,
    )


def not_found_doubt(s: Situation) -> str | None:
    """Why a "not found" cannot prove that nothing ran, or None when it can.

    The one rule behind the reconciler's requeue and staff's "rejected" on a lookup.
    """
    if s.asked < s.quiet_at:
        return "not_quiet"  # a send may still be on the wire, or not yet visible
    if s.clock_trusted_at is not None and s.asked < s.clock_trusted_at:
        return "clock_step"  # the database's clock stepped: quiet_at may be off
    if s.past_retention:
        return "past_key_retention"  # the downstream may have forgotten the key
    return None


def backoff(s: Situation) -> datetime:
    """Next look: doubling from 1 s with the number of lookups, at most MAX_RECHECK."""
    delay = min(MAX_RECHECK, timedelta(seconds=2 ** min(s.lookups, 16)))
    return s.now + delay


def decide(s: Situation, lookup: LookupOutcome | None) -> Change:
    """Decide from one lookup (``None`` where the downstream has no lookup API). The change's
    ``code`` says what was decided, counted per pass."""
    if isinstance(lookup, Found):
        settled = settlement(lookup)
        if settled.state is State.REJECTED and len(s.sends) > 1 and s.asked < s.quiet_at:
            # "Not done" waits for quiescence: the record is the key's refusal, but another
            # request of the operation (a same-key resend's, or the one it followed) may still
            # be on the wire. (It would replay the refusal; rejected promises none can land.)
            return Change.look(
                "wait_quiescence",
                recheck_at=max(s.quiet_at, s.now),
                evidence={"lookup": "found", "found": "rejected"},
            )
        return Change(
            Event.FIND,
            settled.state,
            reason=settled.reason,
            receipt=settled.receipt,
            evidence={"lookup": "found", "reference": lookup.receipt.reference, **settled.evidence},
            code="found",
        )
    if s.state is State.SUBMITTED:
        # The worker died mid-send and nothing was found: the send may still land. First
        # record that the outcome is unknown; the next pass applies the rules below.
        return Change(
            Event.ABANDON,
            State.UNKNOWN,
            next_attempt_at=s.now,
            evidence={"detail": "worker lost during send", "lookup": lookup_name(lookup)},
            code="abandoned",
        )
    if isinstance(lookup, LookupMisuse):
        return _review(s, "lookup_mismatch", mismatch_evidence(lookup))
    if lookup is None and s.may_resend:
        return _resend(s, "none")  # no lookup API: a same-key replay is the one way to know
    if lookup is None:
        why = (
            "no_lookup_without_idempotency"
            if not s.contract.idempotent
            else "no_lookup_replay_cannot_settle"
        )
        return _review(s, why, {"lookup": "none"})
    if not s.contract.idempotent:
        return _review(s, "ambiguous_without_idempotency", {"lookup": lookup_name(lookup)})
    if isinstance(lookup, LookupNotFound):
        doubt = not_found_doubt(s)
        if doubt == "not_quiet" and s.may_resend:
            return _resend(s, "not_found")
        if doubt == "not_quiet":
            return Change.look(
                "wait_quiescence",
                recheck_at=max(s.quiet_at, s.now),
                evidence={"lookup": "not_found"},
            )
        if doubt == "clock_step" and s.clock_trusted_at is not None:
            # Bounded (about a lease), and its end settles it: waiting beats a review item
            # staff could not resolve either (their "not found" has the same doubt).
            return Change.look(
                "wait_clock_step",
                recheck_at=max(s.clock_trusted_at, s.now),
                evidence={
                    "lookup": "not_found",
                    "clock_doubt_until": s.clock_trusted_at.isoformat(),
                },
            )
        if doubt is not None:
            return _review(s, doubt, {"lookup": "not_found"})
        return Change(  # no later time: due at once, with the same key
            Event.REQUEUE,
            State.PLANNED,
            evidence={
                "lookup": "not_found",
                "quiet_since": s.quiet_at.isoformat(),
                **s.contract.assumption(),
                **(
                    {"downstream_lag_seconds": round(s.downstream_lag.total_seconds(), 3)}
                    if s.downstream_lag is not None
                    else {}
                ),
            },
            code="requeued",
        )
    assert isinstance(lookup, Unavailable)
    # "pending": the downstream took it on and has not finished; recorded as such, so that
    # staff are offered no resolution while it is (``support.evidence``).
    name = lookup_name(lookup)
    if s.overdue:
        return _review(s, "lookup_unavailable", {"lookup": name, "detail": lookup.detail})
    return Change.look("lookup_unavailable", recheck_at=backoff(s), evidence={"lookup": name})


def _resend(s: Situation, lookup: str) -> Change:
    """Send it again now with the same key (the executor's checks first): "done" needs no
    wait where the downstream is idempotent; "not done" still waits for ``quiet_at``."""
    return Change(
        Event.RESEND,
        State.SUBMITTED,
        evidence={"lookup": lookup, "resend": "same_key", "quiet_at": s.quiet_at.isoformat()},
        code="resent",
    )


def _review(s: Situation, reason: str, evidence: dict[str, Any]) -> Change:
    """Undeterminable: stays unknown, in the review queue (opened once), looked at again later."""
    return Change.look(
        "in_review" if s.in_review else "to_review",
        review=None if s.in_review else reason,
        recheck_at=backoff(s),
        evidence={**evidence, "review": reason},
    )
