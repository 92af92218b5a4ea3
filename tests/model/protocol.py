"""A model of the send/reconcile protocol: one kind of operation, workers, one reconciler,
staff, a user's cancel, the network and the downstream (``docs/model.md``).

Every decision is made by Settled's own pure functions, and the services' inputs to them are
built by the services' own builders (``Rules`` holds each, a broken variant swaps one):
``workers.verdicts.check_before_send`` (the claim's checks, ``workers.claiming``),
``workers.sending.send_bound`` (the send bounded by the lease less the clock margin, as
``SendsBatches.send_deadline`` uses it, on a ``DbClock`` read at the claim), the real
``workers.http_classify.classify_submit`` reading each HTTP answer of the downstream
(``ProtocolModel.response``), ``judge_submit``, ``judge_resend`` and ``judge_recovery``
(``workers.executor``), ``reconciler.decide.decide`` on the ``Situation`` that
``reconciler.decide.situation_of`` builds (as ``Reconciler._reconcile`` calls it) from the
facts ``outbox.storage.attempts.facts_of`` builds (each attempt's end by ``on_wire_until``,
as ``operation_facts`` reads its row), ``support.resolve.doubt_of`` and ``record_of``
(staff; the latter weighs with ``support.evidence.weigh``), ``outbox.states.transition``
for every move, and ``outbox.report_lines.build_line`` for the report. Only storage, network
and time are modelled:

- **time** is a short row of points ``t0 .. t{H-1}``, ten seconds apart, and a last point
  ``TOP`` long after everything (every lease over, every key forgotten); the clock steps one
  point at a time, and anything may happen between two steps, so a worker "stalls past its
  lease" by not moving while the clock does; a request lands at a point, or at the last
  instant before the next point its fence lets through (``ProtocolModel._late``: the fence
  and the clock margin are in seconds, finer than a point);
- **storage** is the operation's row (state, lease, attempts) with fenced writes: a claim,
  a cancel or a staff resolution makes every earlier claim's write refused (the lease
  version); leases are not renewed (renewal only keeps others from claiming: without it more
  interleavings are explored, never fewer); every operation is always due (``next_attempt_at``
  only narrows when things happen);
- **the network** holds each request that left until it lands or can no longer land: after its
  ``Settled-Deadline`` by the downstream's clock (``MARGIN`` behind the database's, the worst
  the contract allows) where the downstream enforces it, else after the end its sender knew
  plus the declared delay bound;
- **the downstream** keeps a ledger: each landing, when it becomes visible to lookups
  (``visibility`` points later), and forgets a key ``retention`` points after it first landed;
  it answers over HTTP as the wire protocol says (``ANSWERS``: 200 with a receipt, 402, 429,
  409 while the key's first request is processed, and, where ``Config.misuse``, an
  idempotency error or a receipt unlike the intent to a replay).

Workers are anonymous (their tuple is kept sorted) and a claim holds a "current" flag
instead of a version number, so that equal situations are one state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from outbox import wire
from outbox.change import Change
from outbox.clock import DbClock, Deadline, Reading, StepDetector
from outbox.downstream import (
    Accepted,
    Found,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Proof,
    Receipt,
    SendPhase,
    SubmitOutcome,
    Unknown,
    lookup_name,
)
from outbox.downstream_clock import DownstreamClocks, lag_of
from outbox.errors import ReviewConflict
from outbox.kinds import DownstreamContract, Kind, RefundIntent
from outbox.report_lines import Group, OpFacts, build_line
from outbox.states import Event, RejectReason, State, transition
from outbox.storage.attempts import OperationFacts, facts_of
from reconciler.decide import Situation, decide, situation_of
from support.resolve import Resolution, doubt_of, record_of
from support.staff import Role, Staff
from tests.model.engine import Invariant, Step
from workers.http_classify import classify_submit
from workers.sending import send_bound
from workers.verdicts import (
    Budget,
    check_before_send,
    judge_recovery,
    judge_resend,
    judge_submit,
)

BASE = datetime(2026, 1, 1, tzinfo=UTC)
TICK = timedelta(seconds=10)
#: how far after the row of points ``TOP`` lies: past every lease, deadline and key retention
FAR = timedelta(days=3)
#: ``Executor.clock_margin``; the downstream's clock is within it of the database's
MARGIN = timedelta(seconds=1)
#: ``Reconciler.client_timeout`` and ``ReviewQueue.lookup_timeout`` (their defaults)
CLIENT_TIMEOUT = timedelta(seconds=10)
REVIEW_AFTER = timedelta(seconds=600)


@dataclass(frozen=True)
class Config:
    """One configuration of the model: the contract, the actors, the world's faults."""

    name: str = "protocol"
    ops: int = 1
    workers: int = 2
    reconciler: bool = True
    staff: bool = True
    cancel: bool = True
    idempotent: bool = True
    queryable: bool = True
    enforces_deadline: bool = True
    #: the contract's ``max_request_delay``, in points (the network honours it)
    delay: int = 1
    #: the contract's ``key_retention``, in points (less a margin of one point)
    retention: int = 12
    #: points from a landing to its being visible to lookups (the contract's
    #: ``processing_time`` is one point: more breaks the assumption)
    visibility: int = 1
    lease: int = 2
    deadline: int = 3
    max_attempts: int = 2
    throttle: bool = True  # the downstream may answer 429 (refused before processing)
    refusals: bool = False  # the downstream may refuse the refund (a business refusal)
    crashes: bool = True
    #: the reconciler hands what a "not found" cannot settle yet to the executor, which sends
    #: it again with the same key (``Reconciler.resender``, as the runtime builds it)
    resend: bool = True
    #: a broken rule swapped in for the real one (``VARIANTS``), or None
    variant: str | None = None
    #: the world may break the contract's assumptions (``ASSUMPTIONS``): the downstream's
    #: clock this many seconds behind the database's (the contract allows ``MARGIN``), and
    #: requests landing up to this many points after their sender was done (None: the
    #: declared ``delay``)
    world_slew: float = MARGIN.total_seconds()
    world_delay: int | None = None
    #: bounded steps of the database's clock: the sizes, in points (> 0 forward), it may be
    #: set by, at most once in a run (empty: it only slews)
    clock_steps: tuple[int, ...] = ()
    #: ``SETTLED_CLOCK_STEP_DISTRUST_SECONDS`` in points (None: the lease, its default)
    distrust: int | None = None
    #: the clock watch sees a step at the first reading after it (False: no process does,
    #: as when every process restarted after it, ``ASSUMPTIONS``)
    step_seen: bool = True
    #: the downstream's clock is set back with the database's (False: it follows a forward
    #: step, as far behind as the margin allows, and is never set back; ``ASSUMPTIONS``)
    downstream_steps_back: bool = False
    #: the downstream's clock this many seconds behind the database's, and said on every
    #: answer (``Settled-Server-Time``): the reconciler measures it from its lookup's answer
    #: as the product does (``ClockWatch.downstream_answered``, ``lag_of``) and its fence
    #: allows for it; None: the downstream says no time, and is ``world_slew`` behind
    downstream_lag: float | None = None

    @property
    def slew(self) -> float:
        """How far the downstream's clock is behind the database's (seconds)."""
        return self.world_slew if self.downstream_lag is None else self.downstream_lag

    #: the downstream may answer a replay of a key it knows with an idempotency error (the key
    #: reused) or a receipt unlike the intent, executing nothing (it reads the parameters
    #: otherwise): a misuse, a person's to decide
    misuse: bool = False

    @property
    def step_bound(self) -> int:
        """The largest step of the database's clock, in points."""
        return max((abs(step) for step in self.clock_steps), default=0)

    @property
    def horizon(self) -> int:
        """The index of ``TOP``: after every request could have landed."""
        late = 0 if self.enforces_deadline else max(self.delay, self.world_delay or 0)
        slow = math.ceil(max(0.0, self.slew - MARGIN.total_seconds()) / TICK.total_seconds())
        # a sender measures its lease from a reading before a step: it may send up to a step
        # later than its lease says (and a downstream set back may take a request that late)
        stepped = self.step_bound * (2 if self.downstream_steps_back else 1)
        return self.deadline + self.lease + late + self.visibility + slow + stepped + 1

    @property
    def contract(self) -> DownstreamContract:
        return DownstreamContract(
            idempotent=self.idempotent,
            queryable=self.queryable,
            key_retention=self.retention * TICK,
            processing_time=TICK,
            retention_margin=TICK,
            enforces_deadline=self.enforces_deadline,
            max_request_delay=self.delay * TICK,
        )


# ---------------------------------------------------------------- the state


@dataclass(frozen=True)
class Attempt:
    start: int
    lease_end: int  # the lease it was sent under (``attempts.not_after``)
    finished: int | None = None  # its outcome written
    proof: str | None = None
    #: what the downstream answered it (``ANSWERS``), as the world knows it: the classifier
    #: and the verdict read it into ``proof``
    answer: str | None = None


@dataclass(frozen=True)
class Op:
    state: State = State.PLANNED
    lease_end: int | None = None  # the row's lease (None: released)
    tries: int = 0
    first_sent: int | None = None
    attempts: tuple[Attempt, ...] = ()
    in_review: bool = False
    reason: str | None = None
    reference: str | None = None
    receipt_status: str | None = None
    by_staff: bool = False  # settled on staff's statement, no downstream record
    rests_on: str | None = None  # what a trusted "not found" rested on
    #: its last write recorded a misuse answer (an idempotency error, a receipt unlike the
    #: intent): it must be in review
    misused: bool = False

    @property
    def reached(self) -> int:
        return sum(1 for a in self.attempts if a.proof != "not_sent")


@dataclass(frozen=True, order=True)
class Worker:
    #: idle; claimed (attempt started, not sent); sent (waiting); got (answer in hand);
    #: recover (claimed a submitted operation whose worker died)
    phase: str = "idle"
    op: int = -1
    current: bool = False  # its claim still fences the row (no newer claim)
    attempt: int = -1
    outcome: str = ""  # accepted, refused, not_executed, unknown, not_sent
    #: the database clock's offset (points) at its claim: its deadlines are measured on its
    #: monotonic clock from that reading
    off: int = 0
    #: the executor sending an unknown operation again under the reconciler's claim
    #: (``Executor.resend``): judged by ``judge_resend``, gone once it has recorded
    resend: bool = False


@dataclass(frozen=True)
class Rec:
    phase: str = "idle"  # idle; claimed (asked); looked (answer in hand)
    op: int = -1
    current: bool = False
    asked: int = -1  # the claim's time: read before the lookup was asked
    lookup: str | None = None  # found:succeeded, found:rejected, not_found; None: no lookup
    #: the downstream's lag behind the database's its lookup's answer showed (seconds, the
    #: bound ``outbox.downstream_clock.lag_of`` gives); None: the answer said no time
    lag: float | None = None


@dataclass(frozen=True, order=True)
class Request:
    op: int
    attempt: int
    fence: float  # its Settled-Deadline, in seconds from the epoch (as the header: ms)
    #: the latest its sender may be at it (its lease on its monotonic clock, or its outcome
    #: written), in true points; for the delay bound (-1 where the fence bounds it)
    until: int = -1
    #: the parameters it carries: 0 the stored intent's (``DownstreamRequest.of``), else other
    params: int = 0


@dataclass(frozen=True)
class World:
    t: int
    ops: tuple[Op, ...]
    workers: tuple[Worker, ...]
    rec: Rec
    network: tuple[Request, ...] = ()
    #: per operation: its landings at the downstream, (point, "succeeded" | "rejected"); a
    #: point with a fraction where a request landed between two points (its fence's last
    #: instant: ``ProtocolModel._late``)
    ledger: tuple[tuple[tuple[float, str], ...], ...] = ()
    cancelled: bool = False
    #: the database clock's offset from the processes' monotonic clocks, in points (set once
    #: at most: a step); ``t`` is true time, the database's is ``t + off``
    off: int = 0
    #: until when a "not found" is not trusted after the step, as the clock watch recorded it
    #: (``clock_steps``, ``outbox.clock.StepDetector``); None: no step seen
    doubt_until: datetime | None = None


# ---------------------------------------------------------------- the rules


@dataclass(frozen=True)
class Rules:
    """The decisions, as the services make them; a variant overrides one (``VARIANTS``)."""

    def send_bound(self, lease_until: datetime, deadline: datetime) -> datetime:
        """``workers.sending.send_bound`` with ``Executor.clock_margin`` (its default)."""
        return send_bound(lease_until, deadline, MARGIN.total_seconds())

    def send_deadline(
        self, claimed_at: datetime, lease_end: datetime, deadline: datetime, now: datetime
    ) -> Deadline:
        """``SendsBatches.send_deadline``: the bound on a clock read at the claim (``now`` is
        where its monotonic clock has got to)."""
        clock = DbClock(claimed_at, 0.0, lambda: (now - claimed_at).total_seconds())
        return clock.deadline(self.send_bound(lease_end, deadline))

    def situation_of(self, **values: Any) -> Situation:
        """``reconciler.decide.situation_of``, as ``Reconciler._reconcile`` calls it."""
        return situation_of(**values)

    def facts_of(
        self,
        unknown_since: datetime | None,
        lookups: int,
        in_review: bool,
        attempt_times: Sequence[tuple[datetime, datetime | None, datetime | None]],
    ) -> OperationFacts:
        """``outbox.storage.attempts.facts_of`` (``operation_facts`` without the query)."""
        return facts_of(unknown_since, lookups, in_review, attempt_times)

    def classify_submit(
        self, response: httpx.Response, kind: Kind, params: dict[str, Any], key: str
    ) -> SubmitOutcome:
        """``workers.http_classify.classify_submit``, as the HTTP gateway calls it."""
        return classify_submit(response, kind, params, now=BASE, idempotency_key=key)

    def situation(self, s: Situation) -> Situation:
        """The Situation the reconciler decides on (a variant misdates or misreads it)."""
        return s

    def decide(self, s: Situation, lookup: LookupOutcome | None) -> Change:
        return decide(self.situation(s), lookup)

    def resend_check(
        self,
        op: Op,
        now: datetime,
        first_sent_at: datetime | None,
        deadline: datetime,
        max_attempts: int,
        contract: DownstreamContract,
        cancelled: bool,
    ) -> Change | None:
        """``SendClaims.check`` as ``Executor.resend`` calls it: ``check_before_send`` on the
        reconciler's claim (None: send it again)."""
        return check_before_send(
            now=now,
            deadline=deadline,
            attempts=op.tries,
            max_attempts=max_attempts,
            reached_downstream=op.reached,
            first_sent_at=first_sent_at,
            contract=contract,
            run_cancelled=cancelled,
            fingerprint_ok=True,
        )

    def resend_params(self) -> int:
        """What a resend carries: the stored intent (``DownstreamRequest.of`` the claim)."""
        return 0

    def judge_resend(
        self, outcome: SubmitOutcome, contract: DownstreamContract, now: datetime
    ) -> Change:
        return judge_resend(outcome, contract=contract, now=now)

    def staff_doubt(
        self,
        lookup: LookupOutcome | None,
        snapshot: dict[str, Any],
        contract: DownstreamContract,
        facts: OperationFacts,
        clock: DbClock,
        clock_doubt_until: datetime | None,
        *,
        downstream_lag: float | None = None,
    ) -> str | None:
        """``resolve.doubt_of``, as ``ReviewQueue.resolve`` calls it (``downstream_lag``: what
        staff's lookup measured, ``ClockWatch.downstream_lag``)."""
        lag = None if downstream_lag is None else timedelta(seconds=downstream_lag)
        return doubt_of(lookup, snapshot, contract, facts, clock,
                        lookup_timeout=CLIENT_TIMEOUT.total_seconds(),
                        clock_doubt_until=clock_doubt_until,
                        downstream_lag=lag, clock_margin=MARGIN)  # fmt: skip


class SendPastLease(Rules):
    """The send bounded by the operation's deadline only, not by its lease."""

    def send_bound(self, lease_until: datetime, deadline: datetime) -> datetime:
        return deadline


class SendWithoutMargin(Rules):
    """``send_bound`` without the clock margin: the lease's end itself."""

    def send_bound(self, lease_until: datetime, deadline: datetime) -> datetime:
        return min(deadline, lease_until)


class SendWithHalfTheMargin(Rules):
    """``send_bound`` with half the clock margin."""

    def send_bound(self, lease_until: datetime, deadline: datetime) -> datetime:
        return send_bound(lease_until, deadline, MARGIN.total_seconds() / 2)


class DatedWhenAnswered(Rules):
    """``situation_of`` dating a "not found" by the decision's time, not the claim's."""

    def situation_of(self, **values: Any) -> Situation:
        return situation_of(**{**values, "claimed_at": values["now"]})


class OnWireUntilTheOutcome(Rules):
    """``facts_of`` with an attempt's end not bounded by its lease: its outcome's time only
    (none while it is open)."""

    def facts_of(
        self,
        unknown_since: datetime | None,
        lookups: int,
        in_review: bool,
        attempt_times: Sequence[tuple[datetime, datetime | None, datetime | None]],
    ) -> OperationFacts:
        facts = facts_of(unknown_since, lookups, in_review, attempt_times)
        sends = tuple((start, finished) for start, _, finished in attempt_times)
        return replace(facts, sends=sends)


def _error_code(response: httpx.Response) -> tuple[str | None, str | None]:
    error = response.json().get("error") if response.content else None
    return (error.get("type"), error.get("code")) if isinstance(error, dict) else (None, None)


class KeyInUseNotExecuted(Rules):
    """``classify_submit`` reading an in-use key (409) as a definite answer: not executed."""

    def classify_submit(
        self, response: httpx.Response, kind: Kind, params: dict[str, Any], key: str
    ) -> SubmitOutcome:
        if _error_code(response) == (wire.IDEMPOTENCY_ERROR, wire.KEY_IN_USE):
            return NotExecuted(response.status_code)
        return super().classify_submit(response, kind, params, key)


class MisuseAsUnknown(Rules):
    """``classify_submit`` reading an idempotency error (the key reused) as a plain unknown:
    no review."""

    def classify_submit(
        self, response: httpx.Response, kind: Kind, params: dict[str, Any], key: str
    ) -> SubmitOutcome:
        if _error_code(response) == (wire.IDEMPOTENCY_ERROR, wire.KEY_REUSED):
            return Unknown("idempotency error", response.status_code)
        return super().classify_submit(response, kind, params, key)


class MismatchAsAccepted(Rules):
    """``classify_submit`` taking a receipt unlike the intent as the operation's proof."""

    def classify_submit(
        self, response: httpx.Response, kind: Kind, params: dict[str, Any], key: str
    ) -> SubmitOutcome:
        outcome = super().classify_submit(response, kind, params, key)
        body = response.json() if response.content else {}
        if isinstance(outcome, Misuse) and outcome.code == "receipt_mismatch":
            receipt = Receipt(body["id"], body["status"], body["params"], raw=body)
            return Accepted(receipt, response.status_code)
        return outcome


class BeforeQuiescence(Rules):
    """A "not found" trusted before quiescence: as if asked once all was quiet."""

    def situation(self, s: Situation) -> Situation:
        return replace(s, asked_at=max(s.asked, s.quiet_at))


class PastRetention(Rules):
    """A "not found" trusted past the key retention."""

    def situation(self, s: Situation) -> Situation:
        return replace(s, first_sent_at=None) if s.sends else s


class DelayBoundIgnored(Rules):
    """Quiescence reckoned as if no request could land after its sender was done."""

    def situation(self, s: Situation) -> Situation:
        return replace(s, contract=replace(s.contract, max_request_delay=timedelta(0)))


class StaffWithoutProof(Rules):
    """Staff's "rejected" on any "not found", however doubtful."""

    def staff_doubt(self, *args: Any, **kw: Any) -> str | None:
        return None


class ClockStepIgnored(Rules):
    """The reconciler trusts a "not found" as if no step of the database's clock was recorded."""

    def situation(self, s: Situation) -> Situation:
        return replace(s, clock_doubt_until=None)


class MeasuredLagIgnored(Rules):
    """The fence as if the downstream's clock were within the margin: the lag its answers
    showed is not allowed for (``Situation.downstream_lag`` dropped)."""

    def situation(self, s: Situation) -> Situation:
        return replace(s, downstream_lag=None)


class StaffIgnoringMeasuredLag(Rules):
    """Staff are not refused while the downstream's measured lag is not covered (``doubt_of``
    told of none)."""

    def staff_doubt(self, *args: Any, **kw: Any) -> str | None:
        return super().staff_doubt(*args, downstream_lag=None)


class StaffIgnoringClockStep(Rules):
    """Staff are not refused after a step of the database's clock (``doubt_of`` told of none)."""

    def staff_doubt(
        self,
        lookup: LookupOutcome | None,
        snapshot: dict[str, Any],
        contract: DownstreamContract,
        facts: OperationFacts,
        clock: DbClock,
        clock_doubt_until: datetime | None,
        **kw: Any,
    ) -> str | None:
        return super().staff_doubt(lookup, snapshot, contract, facts, clock, None, **kw)


class ResendPastRetention(Rules):
    """A same-key resend allowed past the key retention (its check told of no first send)."""

    def resend_check(
        self,
        op: Op,
        now: datetime,
        first_sent_at: datetime | None,
        deadline: datetime,
        max_attempts: int,
        contract: DownstreamContract,
        cancelled: bool,
    ) -> Change | None:
        return super().resend_check(op, now, None, deadline, max_attempts, contract, cancelled)


class ResendOtherParameters(Rules):
    """A resend that carries other parameters than the stored intent's."""

    def resend_params(self) -> int:
        return 1


#: Each broken rule, and the configuration it must be caught in.
VARIANTS: dict[str, tuple[Rules, Config]] = {
    "send_not_bounded_by_lease": (
        SendPastLease(),
        Config(lease=1, deadline=3, staff=False, cancel=False, throttle=False),
    ),
    "send_bound_without_the_clock_margin": (
        SendWithoutMargin(),
        Config(lease=1, deadline=3, staff=False, cancel=False, throttle=False),
    ),
    "send_bound_with_half_the_clock_margin": (
        SendWithHalfTheMargin(),
        Config(lease=1, deadline=3, staff=False, cancel=False, throttle=False),
    ),
    "not_found_dated_when_answered": (
        DatedWhenAnswered(),
        Config(staff=False, cancel=False, throttle=False),
    ),
    "attempt_end_not_bounded_by_its_lease": (
        OnWireUntilTheOutcome(),
        Config(enforces_deadline=False, staff=False, cancel=False, throttle=False),
    ),
    "key_in_use_read_as_not_executed": (
        KeyInUseNotExecuted(),
        Config(workers=1, staff=False, cancel=False, throttle=False),
    ),
    "idempotency_error_read_as_unknown": (
        MisuseAsUnknown(),
        Config(workers=1, misuse=True, staff=False, cancel=False, throttle=False),
    ),
    "receipt_unlike_the_intent_accepted": (
        MismatchAsAccepted(),
        Config(workers=1, misuse=True, staff=False, cancel=False, throttle=False),
    ),
    "not_found_before_quiescence": (
        BeforeQuiescence(),
        Config(staff=False, cancel=False, throttle=False),
    ),
    "not_found_past_key_retention": (
        PastRetention(),
        Config(staff=False, cancel=False, workers=1, retention=4, throttle=False),
    ),
    "staff_rejecting_without_proof": (
        StaffWithoutProof(),
        Config(idempotent=False, workers=1, cancel=False, throttle=False),
    ),
    "delay_bound_ignored": (
        DelayBoundIgnored(),
        Config(
            enforces_deadline=False, delay=2, lease=1, staff=False, cancel=False, throttle=False
        ),
    ),
    "not_found_trusted_after_a_clock_step": (
        ClockStepIgnored(),
        Config(
            enforces_deadline=False,
            clock_steps=(1,),
            lease=1,
            deadline=1,
            staff=False,
            cancel=False,
            throttle=False,
        ),
    ),
    "resend_past_key_retention": (
        ResendPastRetention(),
        Config(
            retention=3,
            lease=2,
            deadline=4,
            max_attempts=3,
            workers=1,
            staff=False,
            cancel=False,
            throttle=False,
        ),
    ),
    "resend_with_other_parameters": (
        ResendOtherParameters(),
        Config(workers=1, staff=False, cancel=False, throttle=False),
    ),
    "fence_ignoring_the_measured_lag": (
        MeasuredLagIgnored(),
        Config(downstream_lag=11, staff=False, cancel=False, throttle=False),
    ),
    "staff_not_refused_inside_the_measured_lag": (
        StaffIgnoringMeasuredLag(),
        Config(
            downstream_lag=11,
            idempotent=False,
            workers=1,
            lease=1,
            deadline=1,
            cancel=False,
            throttle=False,
        ),
    ),
    "staff_not_refused_after_a_clock_step": (
        StaffIgnoringClockStep(),
        Config(
            enforces_deadline=False,
            idempotent=False,
            clock_steps=(1,),
            workers=1,
            lease=1,
            deadline=1,
            cancel=False,
            throttle=False,
        ),
    ),
}


#: Worlds that break an assumption of the contract, in which the real rules must fail: what
#: each invariant rests on (``docs/model.md``).
ASSUMPTIONS: dict[str, Config] = {
    "clock_slew_beyond_the_margin": Config(world_slew=11, staff=False, cancel=False),
    "requests_later_than_the_delay_bound": Config(
        enforces_deadline=False, world_delay=2, staff=False, cancel=False
    ),
    "visible_later_than_the_processing_time": Config(visibility=2, staff=False, cancel=False),
    "clock_step_unseen": Config(
        enforces_deadline=False, clock_steps=(1,), step_seen=False, staff=False, throttle=False
    ),
    "downstream_clock_set_back": Config(
        clock_steps=(-1,), downstream_steps_back=True, staff=False, throttle=False
    ),
}


# ---------------------------------------------------------------- the model


def at(t: int, horizon: int) -> datetime:
    """The time of point ``t`` (``horizon`` and beyond: ``TOP``, long after everything)."""
    if t < horizon:
        return BASE + t * TICK
    return BASE + FAR + (t - horizon) * TICK


def label(when: datetime | None, horizon: int) -> str:
    """A time as a point, for traces: ``t3``, ``t3-1s``, ``TOP``."""
    if when is None:
        return "-"
    if when >= BASE + FAR:
        return "TOP"
    seconds = (when - BASE).total_seconds()
    n, rest = divmod(seconds, TICK.total_seconds())
    return f"t{int(n)}" + (f"+{rest:g}s" if rest else "")


#: a ledger entry: a refund made with other parameters than the operation's intent
OTHER = "succeeded_otherwise"

#: The intent every modelled operation carries, and its kind (the classifier reads both).
PARAMS: dict[str, Any] = {
    "order_id": "o_1",
    "amount_minor": 500,
    "currency": "EUR",
    "payee": "p_1",
}

#: What each answer of the downstream proves (DESIGN.md, "What an outcome proves";
#: docs/wire-protocol.md): the proof an attempt answered so must be recorded with. The HTTP
#: answers are read by the real classifier (``ProtocolModel.response``); a timeout and a send
#: the lease forbade are the adapter's values.
ANSWERS: dict[str, Proof] = {
    "accepted": Proof.DONE,  # 200 with its receipt (first execution or a replay)
    "refused": Proof.NOT_DONE,  # 402 business_error
    "not_executed": Proof.NOT_EXECUTED,  # 429: refused before processing
    "in_use": Proof.UNKNOWN,  # 409 idempotency_key_in_use: the key's first request runs
    "misuse": Proof.MISUSE,  # 400 idempotency_key_reused
    "mismatch": Proof.MISUSE,  # 200 with a receipt unlike the intent
    "unknown": Proof.UNKNOWN,  # no answer: the client's timeout
    "not_sent": Proof.NOT_SENT,  # the lease ended before sending
}


def _reference(i: int) -> str:
    return f"re_{i}"


def _key(i: int) -> str:
    """Operation ``i``'s idempotency key (stable across its attempts)."""
    return f"stl_model_{i}"


@dataclass
class ProtocolModel:
    config: Config = field(default_factory=Config)
    rules: Rules = field(default_factory=Rules)

    def __post_init__(self) -> None:
        c = self.config
        if c.variant is not None:
            self.rules = VARIANTS[c.variant][0]
        self.name = c.name if c.variant is None else f"{c.name}[{c.variant}]"
        self.contract = c.contract
        self.kind = Kind("refund", RefundIntent, "/v1/refunds", contract=self.contract)
        self._outcomes: dict[tuple[int, str], SubmitOutcome] = {}
        self.H = c.horizon
        # The database's points run up to a step beyond the true ones before ``TOP``.
        self.top = self.H + c.step_bound
        self.deadline = at(c.deadline, self.top)
        #: ``Settings.clock_step_window``: the distrust after a step, the lease by default
        self.window = (c.lease if c.distrust is None else c.distrust) * TICK

    # -- helpers ----------------------------------------------------------------------

    def at(self, p: int | None) -> datetime | None:
        return None if p is None else at(p, self.top)

    def when(self, p: int) -> datetime:
        """The database time of database point ``p`` (every stored time is one)."""
        return at(p, self.top)

    def db(self, t: int, off: int) -> int:
        """The database's point at true point ``t`` with the clock ``off`` (``TOP``: after
        everything, whatever the offset)."""
        return t + off if t < self.H else self.top + t - self.H

    def now(self, w: World) -> int:
        """The database's point now: what a reading of its clock returns."""
        return self.db(w.t, w.off)

    def true_at(self, t: float) -> datetime:
        """True point ``t`` as a time: the downstream's keys and visibility run on it."""
        return at(t, self.H)

    def lbl(self, when: datetime | None) -> str:
        return label(when, self.H)

    def initial(self) -> Iterable[World]:
        c = self.config
        return [
            World(
                t=0,
                ops=(Op(),) * c.ops,
                workers=(Worker(),) * c.workers,
                rec=Rec(),
                ledger=((),) * c.ops,
            )
        ]

    def _with(self, w: World, **changes: Any) -> World:
        out = replace(w, **changes)
        return replace(out, workers=tuple(sorted(out.workers)), network=tuple(sorted(out.network)))

    def _op(self, w: World, i: int, op: Op) -> tuple[Op, ...]:
        return (*w.ops[:i], op, *w.ops[i + 1 :])

    def _fence(self, w: World, i: int) -> World:
        """A newer write on operation ``i``: every earlier claim on it is stale."""
        workers = tuple(
            replace(k, current=False) if k.op == i and k.current else k for k in w.workers
        )
        rec = replace(w.rec, current=False) if w.rec.op == i and w.rec.current else w.rec
        return replace(w, workers=workers, rec=rec)

    def _done(self, w: World, k: Worker) -> tuple[Worker, ...]:
        """The workers once ``k`` is done: idle again, or gone where it was a resend's."""
        if k.resend:
            workers = list(w.workers)
            workers.remove(k)
            return tuple(workers)
        return self._replace_worker(w, k, Worker())

    def _replace_worker(self, w: World, old: Worker, new: Worker) -> tuple[Worker, ...]:
        workers = list(w.workers)
        workers.remove(old)
        workers.append(new)
        return tuple(workers)

    def _reaches(self, r: Request, t: float, off: int) -> bool:
        """Whether request ``r`` may land at true point ``t`` (past ``TOP`` too: the row of
        points continued) with the database's clock ``off``: not after its fence by the
        downstream's clock (the database's less the slew the world allows; stepped with it
        forward, and back only where ``downstream_steps_back``), or not after the end its
        sender knew plus the delay bound (true time: the bound is a duration)."""
        c = self.config
        if self.contract.enforces_deadline:
            follows = off if off > 0 or c.downstream_steps_back else 0
            downstream = BASE + (t + follows) * TICK - timedelta(seconds=c.slew)
            return downstream <= datetime.fromtimestamp(0, UTC) + timedelta(seconds=r.fence)
        delay = c.delay if c.world_delay is None else c.world_delay
        return t <= r.until + delay

    def _can_land(self, w: World, r: Request, t: int) -> bool:
        return t < self.H and self._reaches(r, t, w.off)

    def _may_land(self, w: World, r: Request, t: int) -> bool:
        """Whether ``r`` may land at ``t`` or later: now, or after a step still to come."""
        offsets = (w.off,) if w.off else (0, *self.config.clock_steps)
        return t < self.H and any(self._reaches(r, t, off) for off in offsets)

    def _known(self, w: World, i: int, t: int) -> tuple[float, str] | None:
        """The downstream's record of operation ``i``'s key, if it still remembers it (its
        retention is elapsed time: true points)."""
        for landed, status in w.ledger[i]:
            if self.true_at(t) < self.true_at(landed) + self.contract.key_retention:
                return landed, status
        return None

    def lookup(self, w: World, i: int, t: int) -> str:
        known = self._known(w, i, t)
        if known is None or t < known[0] + self.config.visibility:
            return "not_found"
        return f"found:{known[1]}"

    def _found(self, i: int, code: str | None) -> LookupOutcome | None:
        if code is None:
            return None
        if code == "not_found":
            return LookupNotFound()
        status = code.split(":")[1]
        receipt = Receipt(_reference(i), status, {})
        if status == "succeeded":
            return Found(receipt)
        return Found(receipt, RejectReason.BUSINESS_REJECTED, "declined")

    def _outcome(self, i: int, code: str) -> SubmitOutcome:
        """What the worker's gateway returns for answer ``code`` (``ANSWERS``): an HTTP answer
        read by the classifier (``Rules.classify_submit``), else the adapter's own value."""
        if code == "unknown":
            return Unknown("read timeout")
        if code == "not_sent":
            return NotSent("the lease ended before sending", SendPhase.BEFORE)
        if (i, code) not in self._outcomes:
            key = _key(i)
            self._outcomes[i, code] = self.rules.classify_submit(
                self.response(i, code), self.kind, PARAMS, key
            )
        return self._outcomes[i, code]

    def response(self, i: int, code: str) -> httpx.Response:
        """The downstream's HTTP answer ``code`` to operation ``i``'s request, as the wire
        protocol (and the simulator, ``settled.simulator.submit``) writes it."""

        def error(status: int, kind: str, code: str) -> httpx.Response:
            return httpx.Response(status, json={"error": {"type": kind, "code": code}})

        receipt = {"id": _reference(i), "status": "succeeded", "params": PARAMS,
                   "idempotency_key": _key(i)}  # fmt: skip
        match code:
            case "accepted":
                return httpx.Response(200, json=receipt)
            case "mismatch":
                other = {**PARAMS, "amount_minor": PARAMS["amount_minor"] + 1}
                return httpx.Response(200, json={**receipt, "params": other})
            case "refused":
                return error(402, wire.BUSINESS_ERROR, "declined")
            case "not_executed":
                return httpx.Response(429)
            case "in_use":
                return error(409, wire.IDEMPOTENCY_ERROR, wire.KEY_IN_USE)
            case "misuse":
                return error(400, wire.IDEMPOTENCY_ERROR, wire.KEY_REUSED)
        raise ValueError(f"not an HTTP answer: {code}")

    def _apply(self, op: Op, change: Change, t: int) -> Op:
        """A change written on the row (its lease released), checked by the transition table."""
        if change.event is None:  # a look: no move
            in_review = op.in_review or change.review is not None
            return replace(op, lease_end=None, in_review=in_review, misused=False)
        assert change.to is not None
        to = transition(op.state, change.event, change.to, change.reason)
        receipt = change.receipt or {}
        op = replace(op, misused=False)
        rests_on = change.evidence.get("rests_on") if change.event is Event.REQUEUE else None
        out = replace(
            op,
            state=to,
            lease_end=None,
            reason=change.reason.value if change.reason else None,
            reference=receipt.get("reference"),
            receipt_status=receipt.get("status"),
            rests_on=rests_on if rests_on is not None else op.rests_on,
            in_review=(op.in_review or change.review is not None) and to is State.UNKNOWN,
        )
        return out

    def measured_lag(self, w: World, asked: int) -> float | None:
        """The lag the reconciler measures from its lookup's answer, as the product does: the
        downstream says its clock (the database's now less the world's lag, stepped as
        ``_reaches`` steps it) between the claim's reading and now, and the process's
        ``DownstreamClocks`` gives the worst bound (``ClockWatch.downstream_lag``)."""
        c = self.config
        if c.downstream_lag is None:
            return None
        follows = w.off if w.off > 0 or c.downstream_steps_back else 0
        db_after = self.when(self.now(w))
        said = db_after - (w.off - follows) * TICK - timedelta(seconds=c.slew)
        clocks = DownstreamClocks(margin=MARGIN.total_seconds())
        clocks.observe(
            "refund",
            lag_of(
                said, wire.SERVER_TIME_RESOLUTION, db_before=self.when(asked), db_after=db_after
            ),
        )
        return clocks.worst("refund", since=self.when(asked))

    def situation(self, w: World, i: int, state: State, asked: int, t: int) -> Situation:
        """What the reconciler passes (``Reconciler._reconcile``, through ``situation_of``):
        ``asked`` (the claim's reading) and ``t`` are database points, and the clock watch's
        doubt is the recorded step's."""
        op = w.ops[i]
        return self.rules.situation_of(
            state=state,
            contract=self.contract,
            deadline=self.deadline,
            first_sent_at=self.at(op.first_sent),
            claimed_at=self.when(asked),
            facts=self.facts_of(w, i, op.in_review),
            now=self.when(t),
            client_timeout=CLIENT_TIMEOUT.total_seconds(),
            review_after=REVIEW_AFTER.total_seconds(),
            clock_doubt_until=w.doubt_until,
            resend=self.config.resend,
            downstream_lag=None if w.rec.lag is None else timedelta(seconds=w.rec.lag),
            clock_margin=MARGIN,
        )

    def facts_of(self, w: World, i: int, in_review: bool) -> OperationFacts:
        """``storage.attempts.operation_facts`` of operation ``i`` (``Rules.facts_of`` on its
        attempt rows: started, ``not_after``, ``finished_at``)."""
        times = tuple(
            (self.when(a.start), self.when(a.lease_end), self.at(a.finished))
            for a in w.ops[i].attempts
        )
        return self.rules.facts_of(None, 0, in_review, times)

    # -- the steps ----------------------------------------------------------------------

    def successors(self, w: World) -> Iterator[tuple[Step, World]]:
        for step, nxt in self._steps(w):
            yield step, self.canon(nxt)

    def canon(self, w: World) -> World:
        """One state for equal situations: a stale claim that can no longer send is idle (all
        it could still do is a write the fence refuses), and the workers and the network are
        sorted."""
        workers = tuple(
            sorted(
                k if k.current or k.phase == "claimed" else Worker()
                for k in w.workers
                if not k.resend or k.current or k.phase == "claimed"  # a resend's is gone
            )
        )
        rec = w.rec if w.rec.current or w.rec.phase == "idle" else Rec()
        return replace(w, workers=workers, rec=rec, network=tuple(sorted(w.network)))

    def _steps(self, w: World) -> Iterator[tuple[Step, World]]:
        yield from self._clock(w)
        yield from self._db_clock(w)
        for k in sorted(set(w.workers)):
            yield from self._worker(w, k)
        yield from self._network(w)
        if self.config.reconciler:
            yield from self._reconciler(w)
        if self.config.staff:
            yield from self._staff(w)
        if self.config.cancel and not w.cancelled:
            yield from self._cancel(w)

    def _clock(self, w: World) -> Iterator[tuple[Step, World]]:
        if w.t < self.H:
            t = w.t + 1
            network = tuple(r for r in w.network if self._may_land(w, r, t))
            if t == self.H:
                offsets = (w.off,) if w.off else (0, *self.config.clock_steps)
                assert not any(self._reaches(r, t, off) for r in w.network for off in offsets), (
                    "the horizon is too short: a request could still land at TOP"
                )
            lost = len(w.network) - len(network)
            detail = (("requests that can no longer land", lost),) if lost else ()
            name = "TOP" if t == self.H else f"t{t}"
            yield Step("clock", f"to {name}", detail), replace(w, t=t, network=network)
        elif any(op.lease_end is not None and op.lease_end >= self.now(w) for op in w.ops):
            ops = tuple(
                replace(op, lease_end=self.now(w) - 1)
                if op.lease_end is not None and op.lease_end >= self.now(w)
                else op
                for op in w.ops
            )
            yield (
                Step("clock", "time passes at TOP: the leases taken there lapse"),
                replace(w, ops=ops),
            )

    def _db_clock(self, w: World) -> Iterator[tuple[Step, World]]:
        """The database's clock is set (stepped) by one of ``clock_steps``, once at most. The
        processes read it all the time (a claim, a pass, a staff lookup): the first reading
        after the step goes to the real ``StepDetector`` against the one before it, and the
        step it shows is recorded (``ClockWatch.record``). Seen at once is the worst case: a
        later sighting only ends the distrust later."""
        c = self.config
        if w.off or w.t >= self.H:
            return
        mono = (w.t * TICK).total_seconds()
        for step in c.clock_steps:
            detector = StepDetector(
                margin=MARGIN.total_seconds(), window=self.window.total_seconds()
            )
            detector.observe(Reading(self.when(self.now(w)), mono))
            seen = detector.observe(Reading(self.when(self.db(w.t, step)), mono))
            doubt = seen.distrust_until if seen is not None and c.step_seen else None
            how = "forward" if step > 0 else "back"
            watch = "unseen" if doubt is None else f"seen, distrust until {self.lbl(doubt)}"
            detail = (("database", f"t{self.db(w.t, step)}"), ("clock watch", watch))
            yield (
                Step("db clock", f"set {how} {abs(step) * TICK.total_seconds():g} s", detail),
                self._stepped(w, step, doubt),
            )

    def _stepped(self, w: World, step: int, doubt: datetime | None) -> World:
        """``w`` after the step: a request the downstream's clock now puts past its fence can
        no longer land."""
        out = replace(w, off=step, doubt_until=doubt)
        return replace(out, network=tuple(r for r in w.network if self._may_land(out, r, w.t)))

    def _lease_free(self, op: Op, p: int) -> bool:
        """Whether ``op``'s lease is over at database point ``p``."""
        return op.lease_end is None or op.lease_end < p

    def _worker(self, w: World, k: Worker) -> Iterator[tuple[Step, World]]:
        c = self.config
        if k.phase != "idle" and c.crashes:
            yield (
                Step("worker", f"crashes ({k.phase}, op{k.op})"),
                self._with(w, workers=self._done(w, k)),
            )
        if k.phase == "idle":
            for i, op in enumerate(w.ops):
                if not self._lease_free(op, self.now(w)):
                    continue
                if op.state is State.PLANNED:
                    yield self._claim(w, k, i)
                elif op.state is State.SUBMITTED:
                    fenced = self._fence(w, i)
                    ops = self._op(fenced, i, replace(op, lease_end=self.now(w) + c.lease))
                    new = Worker("recover", i, True)
                    workers = self._replace_worker(fenced, k, new)
                    yield (
                        Step("worker", f"claims op{i} (submitted, lease over): recovery"),
                        (self._with(fenced, ops=ops, workers=workers)),
                    )
        elif k.phase == "claimed":
            yield self._send(w, k)
        elif k.phase == "sent":
            new = replace(k, phase="got", outcome="unknown")
            yield (
                Step("worker", f"op{k.op}: no answer (client timeout)"),
                self._with(w, workers=self._replace_worker(w, k, new)),
            )
        elif k.phase == "got":
            yield self._record(w, k)
        elif k.phase == "recover":
            yield self._recover(w, k)

    def _claim(self, w: World, k: Worker, i: int) -> tuple[Step, World]:
        c, t, op = self.config, self.now(w), w.ops[i]  # the claim reads the database's clock
        stop = check_before_send(
            now=self.when(t),
            deadline=self.deadline,
            attempts=op.tries,
            max_attempts=c.max_attempts,
            reached_downstream=op.reached,
            first_sent_at=self.at(op.first_sent),
            contract=self.contract,
            run_cancelled=w.cancelled,
            fingerprint_ok=True,
        )
        fenced = self._fence(w, i)
        if stop is not None:
            ops = self._op(fenced, i, self._apply(op, stop, t))
            step = Step(
                "worker",
                f"claims op{i}, check_before_send stops it",
                (
                    ("tries", op.tries),
                    ("reached", op.reached),
                    ("stop", stop.stop),
                    ("to", stop.to),
                ),
            )
            return step, self._with(fenced, ops=ops)
        attempt = Attempt(t, t + c.lease)
        started = replace(
            op,
            state=transition(op.state, Event.CLAIM),
            lease_end=t + c.lease,
            tries=op.tries + 1,
            first_sent=op.first_sent if op.first_sent is not None else t,
            attempts=(*op.attempts, attempt),
        )
        new = Worker("claimed", i, True, len(op.attempts), off=w.off)
        step = Step(
            "worker",
            f"claims op{i}, checks pass, attempt {len(op.attempts) + 1} started",
            (("lease until", f"t{t + c.lease}"),),
        )
        return step, self._with(
            fenced, ops=self._op(fenced, i, started), workers=self._replace_worker(fenced, k, new)
        )

    def _send(self, w: World, k: Worker) -> tuple[Step, World]:
        op = w.ops[k.op]
        a = op.attempts[k.attempt]
        # measured on its monotonic clock from its claim's reading (whatever the database's
        # clock did since)
        bound = self.rules.send_deadline(
            self.when(a.start),
            self.when(a.lease_end),
            self.deadline,
            self.when(self.db(w.t, k.off)),
        )
        deadline = bound.at
        detail = (("send deadline", self.lbl(deadline)),)
        if bound.left() <= 0:  # as ``Executor._send_one``
            new = replace(k, phase="got", outcome="not_sent")
            step = Step("worker", f"op{k.op}: not sent, the lease ended first", detail)
            return step, self._with(w, workers=self._replace_worker(w, k, new))
        fence = round((deadline - datetime.fromtimestamp(0, UTC)).total_seconds(), 3)
        until = -1 if self.contract.enforces_deadline else a.lease_end - k.off
        params = self.rules.resend_params() if k.resend else 0
        request = Request(k.op, k.attempt, fence, until, params)
        new = replace(k, phase="sent")
        step = Step("worker", f"op{k.op}: the request leaves", detail)
        return step, self._with(
            w, workers=self._replace_worker(w, k, new), network=(*w.network, request)
        )

    def _record(self, w: World, k: Worker) -> tuple[Step, World]:
        c, t = self.config, self.now(w)  # ``finished_at``: the database's time
        op = w.ops[k.op]
        idle = self._done(w, k)
        if not k.current or op.state is not State.SUBMITTED:
            step = Step("worker", f"op{k.op}: records {k.outcome}: refused (stale lease)")
            return step, self._with(w, workers=idle)
        outcome = self._outcome(k.op, k.outcome)
        sent_at = self.when(self.db(w.t, k.off))  # ``Sent.at``: the worker's clock
        if k.resend:
            change = self.rules.judge_resend(outcome, self.contract, sent_at)
        else:
            change = judge_submit(
                outcome,
                budget=Budget(op.tries, op.reached, c.max_attempts, self.deadline),
                contract=self.contract,
                now=sent_at,
                rand=lambda: 0.5,
            )
        attempts = list(op.attempts)
        attempts[k.attempt] = replace(
            attempts[k.attempt], finished=t, proof=outcome.proof.value, answer=k.outcome
        )
        done = self._apply(replace(op, attempts=tuple(attempts)), change, t)
        done = replace(done, misused=ANSWERS[k.outcome] is Proof.MISUSE)
        step = Step(
            "worker",
            f"op{k.op}: {'judge_resend' if k.resend else 'judge_submit'}({k.outcome})",
            (
                ("tries", op.tries),
                ("reached", op.reached),
                ("event", change.event),
                ("to", change.to),
                ("stop", change.stop),
                ("review", change.review),
            ),
        )
        # its sender is done: a request of this attempt lands by the delay bound from now
        network = tuple(
            replace(r, until=min(r.until, w.t))
            if (r.op, r.attempt) == (k.op, k.attempt) and r.until >= 0
            else r
            for r in w.network
        )
        fenced = self._fence(replace(w, workers=idle, network=network), k.op)
        return step, self._with(fenced, ops=self._op(fenced, k.op, done))

    def _recover(self, w: World, k: Worker) -> tuple[Step, World]:
        t, op = w.t, w.ops[k.op]
        idle = self._replace_worker(w, k, Worker())
        code = self.lookup(w, k.op, t) if self.contract.queryable else None
        change = judge_recovery(self._found(k.op, code))
        if not k.current or op.state is not State.SUBMITTED:
            step = Step("worker", f"op{k.op}: recovery lookup {code}: refused (stale lease)")
            return step, self._with(w, workers=idle)
        step = Step(
            "worker",
            f"op{k.op}: judge_recovery(lookup={code})",
            (("event", change.event), ("to", change.to)),
        )
        fenced = self._fence(replace(w, workers=idle), k.op)
        return step, self._with(fenced, ops=self._op(fenced, k.op, self._apply(op, change, t)))

    def _late(self, w: World, r: Request, t: int) -> float:
        """How far past point ``t`` (a fraction of a point) request ``r`` may still land where
        it can land at ``t`` but no longer at ``t + 1``: the last instant its fence lets
        through, to a hundredth of a second (the fence and the clock margin are in seconds;
        0 where it may land at the next point, or the bound is in points)."""
        if not self._reaches(r, t, w.off) or self._reaches(r, t + 1, w.off):
            return 0.0
        low, high = 0.0, 1.0  # it reaches the downstream at t + low, not at t + high
        for _ in range(20):
            middle = (low + high) / 2
            low, high = (middle, high) if self._reaches(r, t + middle, w.off) else (low, middle)
        return math.floor(low * 1000) / 1000

    def _network(self, w: World) -> Iterator[tuple[Step, World]]:
        """A request in flight lands: at the point, or (``_late``) at the last instant before
        the next point its fence allows."""
        t = w.t
        for r in sorted(set(w.network)):
            if not self._can_land(w, r, t):
                continue
            late = self._late(w, r, t)
            yield from self._lands(w, r, t)
            if late:
                yield from self._lands(w, r, t, late)

    def _lands(
        self, w: World, r: Request, t: int, late: float = 0.0
    ) -> Iterator[tuple[Step, World]]:
        """Request ``r`` lands at point ``t`` (plus ``late`` of a point), and the downstream
        answers; the answer reaches its worker if one still waits for it."""
        c = self.config
        rest = list(w.network)
        rest.remove(r)
        i = r.op
        landed = t + late
        answers: list[tuple[str, str, tuple[tuple[float, str], ...]]] = []
        if c.throttle:
            answers.append(("429, refused before processing", "not_executed", w.ledger[i]))
        known = self._known(w, i, t)
        if c.idempotent and known is not None and (r.params or known[1] == OTHER):
            # the key's first request carried other parameters than this one
            answers.append(("an idempotency error", "misuse", w.ledger[i]))
        elif c.idempotent and known is not None:
            reply = "accepted" if known[1] == "succeeded" else "refused"
            answers.append((f"a replay of its key: {reply}", reply, w.ledger[i]))
            if t < known[0] + c.visibility:  # the key's first request is still processed
                answers.append(("409, its key in use", "in_use", w.ledger[i]))
            if c.misuse:
                answers.append(("an idempotency error (the key reused)", "misuse", w.ledger[i]))
                answers.append(("a replay's receipt unlike the intent", "mismatch", w.ledger[i]))
        else:
            made = OTHER if r.params else "succeeded"
            answers.append(
                (
                    "executed: the refund is made" + (" with other parameters" if r.params else ""),
                    "accepted",
                    w.ledger[i] + ((landed, made),),
                )
            )
            if c.refusals:
                answers.append(("refused: the refund is declined", "refused",
                                w.ledger[i] + ((landed, "rejected"),)))  # fmt: skip
        waiting = [
            k for k in w.workers if k.phase == "sent" and (k.op, k.attempt) == (i, r.attempt)
        ]
        when = f" at {self.lbl(self.true_at(landed))}" if late else ""
        for what, reply, entries in answers:
            ledger = (*w.ledger[:i], entries, *w.ledger[i + 1 :])
            base = replace(w, network=tuple(rest), ledger=ledger)
            head = f"op{i} attempt {r.attempt + 1} lands{when}: {what}"
            if waiting:
                got = replace(waiting[0], phase="got", outcome=reply)
                workers = self._replace_worker(w, waiting[0], got)
                yield (
                    Step("downstream", head + "; the answer reaches its worker"),
                    (self._with(base, workers=workers)),
                )
            if not waiting:
                yield Step("downstream", head + "; the answer is lost"), self._with(base)

    def _reconciler(self, w: World) -> Iterator[tuple[Step, World]]:
        c, t, rec = self.config, w.t, w.rec
        if rec.phase != "idle" and c.crashes:
            yield Step("reconciler", f"crashes ({rec.phase}, op{rec.op})"), replace(w, rec=Rec())
        if rec.phase == "idle":
            now = self.now(w)  # the claim's reading: the lookup is dated by it
            for i, op in enumerate(w.ops):
                if not self._lease_free(op, now) or op.state not in (
                    State.UNKNOWN,
                    State.SUBMITTED,
                ):
                    continue
                fenced = self._fence(w, i)
                ops = self._op(fenced, i, replace(op, lease_end=now + c.lease))
                queryable = self.contract.queryable
                new = Rec("claimed" if queryable else "looked", i, True, now)
                step = Step("reconciler", f"claims op{i} ({op.state}), asks at t{now}")
                yield step, replace(fenced, ops=ops, rec=new)
        elif rec.phase == "claimed":
            code = self.lookup(w, rec.op, t)
            step = Step("downstream", f"answers the reconciler's lookup of op{rec.op}: {code}")
            lag = self.measured_lag(w, rec.asked)
            yield step, replace(w, rec=replace(rec, phase="looked", lookup=code, lag=lag))
        elif rec.phase == "looked":
            yield self._decide(w, rec)

    def _decide(self, w: World, rec: Rec) -> tuple[Step, World]:
        t, i = self.now(w), rec.op
        op = w.ops[i]
        idle = replace(w, rec=Rec())
        if not rec.current:
            return Step("reconciler", f"op{i}: decision refused (stale lease)"), idle
        s = self.situation(w, i, op.state, rec.asked, t)
        change = self.rules.decide(s, self._found(i, rec.lookup))
        if change.event is Event.RESEND:
            stop = self.rules.resend_check(
                op,
                self.when(t),
                self.at(op.first_sent),
                self.deadline,
                self.config.max_attempts,
                self.contract,
                w.cancelled,
            )
            if stop is None:
                return self._resend(idle, i, t, s)
            # as ``Reconciler._resend``: the executor would not send it; decided as without
            change = self.rules.decide(replace(s, resend=False), self._found(i, rec.lookup))
        step = Step(
            "reconciler",
            f"op{i}: decide(lookup={lookup_name(self._found(i, rec.lookup))})",
            (("asked", f"t{rec.asked}"), ("now", f"t{t}"), ("quiet_at", self.lbl(s.quiet_at)),
             *((("clock_trusted_at", self.lbl(s.clock_trusted_at)),) if w.doubt_until else ()),
             ("code", change.code), ("to", change.to), ("review", change.review)),
        )  # fmt: skip
        fenced = self._fence(idle, i)
        return step, replace(fenced, ops=self._op(fenced, i, self._apply(op, change, t)))

    def _resend(self, w: World, i: int, t: int, s: Situation) -> tuple[Step, World]:
        """``Executor.resend``: the attempt started under the reconciler's claim (its lease),
        ``submitted``, then sent by the executor as any claim's send (``_send``)."""
        op = w.ops[i]
        assert op.lease_end is not None  # the reconciler's claim
        started = replace(
            op,
            state=transition(op.state, Event.RESEND),
            tries=op.tries + 1,
            first_sent=op.first_sent if op.first_sent is not None else t,
            attempts=(*op.attempts, Attempt(t, op.lease_end)),
        )
        sender = Worker("claimed", i, True, len(op.attempts), off=w.off, resend=True)
        step = Step(
            "reconciler",
            f"op{i}: decide: not settled yet, sent again with the same key (attempt "
            f"{len(op.attempts) + 1})",
            (
                ("now", f"t{t}"),
                ("quiet_at", self.lbl(s.quiet_at)),
                ("lease until", f"t{op.lease_end}"),
            ),
        )
        return step, self._with(w, ops=self._op(w, i, started), workers=(*w.workers, sender))

    def _staff(self, w: World) -> Iterator[tuple[Step, World]]:
        """``ReviewQueue.resolve``: a fresh lookup, its doubt (``resolve.doubt_of``), and what
        the resolution stores (``resolve.record_of``, which weighs it: ``evidence.weigh``)."""
        t = w.t
        for i, op in enumerate(w.ops):
            if op.state is not State.UNKNOWN or not op.in_review:
                continue
            code = self.lookup(w, i, t) if self.contract.queryable else None
            lookup = self._found(i, code)
            # asked and answered at ``t``, the database's clock read just before
            clock = DbClock(self.when(self.now(w)), 0.0, lambda: 0.0)
            snapshot, facts = self._snapshot(w, i), self._facts(w, i)
            doubt = self.rules.staff_doubt(
                lookup, snapshot, self.contract, facts, clock, w.doubt_until,
                downstream_lag=self.measured_lag(w, self.now(w)),
            )  # fmt: skip
            for to in (State.SUCCEEDED, State.REJECTED):
                for override in (False, True):
                    reference = _reference(i) if to is State.SUCCEEDED else None
                    role = Role.SUPERVISOR if override else Role.SUPPORT
                    resolution = Resolution(Staff("staff-1", role), 1, to, 1, reference,
                                            "checked with the provider", override)  # fmt: skip
                    try:
                        record = record_of(resolution, lookup, doubt=doubt, contract=self.contract)
                    except ReviewConflict:
                        continue
                    if override and "unproven" not in record.evidence:
                        continue  # the same write as without the override
                    receipt = record.receipt or {}
                    resolved = replace(
                        op,
                        state=transition(op.state, Event.RESOLVE, to, record.reason),
                        lease_end=None,
                        in_review=False,
                        reason=record.reason.value if record.reason else None,
                        reference=receipt.get("reference"),
                        receipt_status=receipt.get("status"),
                        # as the report reads a row (``outbox.runs``)
                        by_staff=receipt.get("source") == "staff",
                        rests_on=record.evidence.get("rests_on", op.rests_on),
                        misused=False,
                    )
                    how = " (override)" if override else ""
                    step = Step(
                        "staff",
                        f"resolves op{i} as {to}{how}",
                        (("lookup", lookup_name(lookup)), ("now", f"t{self.now(w)}"),
                         ("doubt", doubt), ("unproven", record.evidence.get("unproven"))),
                    )  # fmt: skip
                    fenced = self._fence(w, i)
                    yield step, replace(fenced, ops=self._op(fenced, i, resolved))

    def _snapshot(self, w: World, i: int) -> dict[str, Any]:
        return {"deadline": self.deadline, "first_sent_at": self.at(w.ops[i].first_sent)}

    def _facts(self, w: World, i: int) -> OperationFacts:
        """``storage.attempts.operation_facts`` of operation ``i``, in review."""
        return self.facts_of(w, i, True)

    def _cancel(self, w: World) -> Iterator[tuple[Step, World]]:
        """``cancel_run``: the run's flag, and every planned operation cancelled (fenced)."""
        out = replace(w, cancelled=True)
        for i, op in enumerate(w.ops):
            if op.state is State.PLANNED:
                out = self._fence(out, i)
                gone = replace(op, state=transition(op.state, Event.CANCEL), lease_end=None)
                out = replace(out, ops=self._op(out, i, gone))
        yield Step("user", "cancels the run"), out

    # -- properties ---------------------------------------------------------------------

    def settled(self, w: World) -> bool:
        return all(
            op.state.terminal or (op.state is State.UNKNOWN and op.in_review) for op in w.ops
        )

    def invariants(self) -> Sequence[Invariant]:
        return [
            Invariant("at most one effect", self._at_most_one),
            Invariant("rejected or cancelled: no effect, none to come", self._nothing_if_not_done),
            Invariant("succeeded: exactly one matching effect", self._one_if_done),
            Invariant("the report line agrees with the ledger", self._report_agrees),
            Invariant("no effect unlike the intent", self._as_intended),
            Invariant("each answer is read as what it proves", self._read_as_proven),
            Invariant("a misuse answer goes to review", self._misuse_reviewed),
        ]

    def _read_as_proven(self, w: World) -> str | None:
        for i, op in enumerate(w.ops):
            for n, a in enumerate(op.attempts):
                if a.answer is not None and a.proof != ANSWERS[a.answer]:
                    return (
                        f"op{i} attempt {n + 1}: the answer {a.answer} recorded as proving "
                        f"{a.proof} (it proves {ANSWERS[a.answer]})"
                    )
        return None

    def _misuse_reviewed(self, w: World) -> str | None:
        for i, op in enumerate(w.ops):
            if op.misused and not op.in_review:
                return f"op{i}: a misuse answer recorded as {op.state}, not in review"
        return None

    def _as_intended(self, w: World) -> str | None:
        for i in range(len(w.ops)):
            if any(status == OTHER for _, status in w.ledger[i]):
                return f"op{i}: the downstream made a refund unlike the intent"
        return None

    def _effects(self, w: World, i: int) -> int:
        return sum(1 for _, status in w.ledger[i] if status in ("succeeded", OTHER))

    def _at_most_one(self, w: World) -> str | None:
        for i in range(len(w.ops)):
            if self._effects(w, i) > 1:
                return f"op{i} has {self._effects(w, i)} effects downstream"
        return None

    def _nothing_if_not_done(self, w: World) -> str | None:
        for i, op in enumerate(w.ops):
            if op.state not in (State.REJECTED, State.CANCELLED) or op.by_staff:
                continue
            if self._effects(w, i):
                return f"op{i} is {op.state} but the downstream made the refund"
            if any(r.op == i for r in w.network):
                return f"op{i} is {op.state} but a request of it can still land"
        return None

    def _one_if_done(self, w: World) -> str | None:
        for i, op in enumerate(w.ops):
            matching = self._effects(w, i) == 1 and op.reference == _reference(i)
            if op.state is State.SUCCEEDED and not op.by_staff and not matching:
                return f"op{i} succeeded with {self._effects(w, i)} matching effects"
        return None

    def facts(self, w: World, i: int) -> OpFacts:
        op = w.ops[i]
        return OpFacts(
            op_id=f"op{i}",
            kind="refund",
            state=op.state,
            reason=op.reason,
            reference=op.reference,
            receipt_status=op.receipt_status,
            in_review=op.in_review,
            sent=bool(op.attempts),
            by_staff=op.by_staff,
            rests_on=op.rests_on,
            max_request_delay_seconds=self.contract.max_request_delay.total_seconds(),
        )

    def _report_agrees(self, w: World) -> str | None:
        for i, op in enumerate(w.ops):
            line = build_line(self.facts(w, i), cancelled=w.cancelled)
            effects = self._effects(w, i)
            if op.by_staff:
                if not line.message.endswith("_staff"):
                    return f"op{i}: staff's statement reported as {line.message}"
            elif line.group is Group.DONE and effects != 1:
                return f"op{i} reported done ({line.message}) with {effects} effects"
            elif line.group is Group.NOT_DONE and effects:
                return f"op{i} reported not done ({line.message}) but the refund was made"
        return None

    def describe(self, w: World) -> str:
        point = "TOP" if w.t >= self.H else f"t{w.t}"
        if w.off and w.t < self.H:  # stored times are the database's
            point += f", the database's clock t{self.now(w)}"
        if w.doubt_until is not None:
            point += f", clock step recorded: distrust until {self.lbl(w.doubt_until)}"
        lines = [f"time {point}" + ("; run cancelled" if w.cancelled else "")]
        for i, op in enumerate(w.ops):
            attempts = ", ".join(
                f"[t{a.start} lease t{a.lease_end} "
                + (f"done t{a.finished} {a.proof}]" if a.finished is not None else "open]")
                for a in op.attempts
            )
            lease = "-" if op.lease_end is None else f"t{op.lease_end}"
            extra = "".join(
                f" {k}={v}"
                for k, v in (
                    ("reason", op.reason),
                    ("ref", op.reference),
                    ("rests_on", op.rests_on),
                )
                if v is not None
            )
            flags = (" in_review" if op.in_review else "") + (" by_staff" if op.by_staff else "")
            lines.append(f"op{i}: {op.state} lease {lease} tries {op.tries}{extra}{flags}")
            if attempts:
                lines.append(f"  attempts: {attempts}")
            ledger = (
                ", ".join(f"{self.lbl(self.true_at(at))} {s}" for at, s in w.ledger[i]) or "nothing"
            )
            lines.append(f"  downstream: {ledger}")
        busy = [k for k in w.workers if k.phase != "idle"]
        for k in busy:
            stale = "" if k.current else " (stale)"
            lines.append(f"worker: {k.phase} op{k.op}{stale} {k.outcome}".rstrip())
        if w.rec.phase != "idle":
            r = w.rec
            stale = "" if r.current else " (stale)"
            lines.append(f"reconciler: {r.phase} op{r.op}{stale} asked t{r.asked} {r.lookup}")
        for r in w.network:
            lines.append(f"network: op{r.op} attempt {r.attempt + 1} in flight")
        return "\n".join(lines)


def model(config: Config | None = None, **changes: Any) -> ProtocolModel:
    """The protocol model of ``config`` (with ``changes``)."""
    return ProtocolModel(replace(config or Config(), **changes))
