"""One operation's line in a run's report: its group, its message key, the evidence it rests
on, and where its compensations stand.

Pure, and built from ``OpFacts`` only (states, reject reasons, receipt references, whether an
attempt was ever made, and for an uncertain one when it is decided at the latest), never from
free text: a line says "not sent" only when no attempt was
ever made; "restored" only when the compensation succeeded *and* carries the downstream's
receipt; an outcome support staff settled by their own statement (no downstream record) is
their statement. The whole report is ``outbox.report``; the sentences, ``outbox.report_text``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from outbox.retry import STOPS
from outbox.states import State
from outbox.verdict_due import VerdictDue


class Group(enum.StrEnum):
    DONE = "done"
    NOT_DONE = "not_done"
    UNCERTAIN = "uncertain"


class Compensation(enum.StrEnum):
    """Where the compensations of an operation stand, best first."""

    RESTORED = "restored"  # a compensation succeeded and its receipt says so
    STAFF = "staff"  # support staff recorded it done, on their own statement
    PENDING = "pending"  # sent, or recorded done without a receipt: not confirmed
    NOT_SENT = "not_sent"  # planned: not sent yet
    NOT_DONE = "not_done"  # rejected or cancelled: the offset did not happen


@dataclass(frozen=True)
class Stopped:
    """Where the tries of an operation given up as ``not_executed`` stopped: its give-up
    event's ``stop`` (``outbox.retry.STOPS``) and what it spent, and what its last try met."""

    stop: str
    tries: int  # every try made, those whose request never left included
    reached: int  # the tries that reached the service
    seconds: float | None = None  # from the first try to the give-up
    last_proof: str | None = None  # the last try's proof: not_sent, not_executed, ...
    last_status: int | None = None
    last_phase: str | None = None  # where a try that never left stopped (``SendPhase``)
    last_detail: str | None = None  # why (``ConnectError``, ``ConnectTimeout``, ...)

    def cause(self) -> str | None:
        """What the service did to the last try, as a message key's tail (None: not said)."""
        if self.last_proof == "not_sent":
            refused = self.last_phase == "connect" and self.last_detail == "ConnectError"
            return "refused" if refused else "unreachable"
        if self.last_proof == "not_executed":
            return "busy" if self.last_status == 429 else "not_processed"
        return None


@dataclass(frozen=True)
class OpFacts:
    """What the report may know about one operation."""

    op_id: str
    kind: str
    state: State
    reason: str | None = None  # reject reason (states.RejectReason)
    code: str | None = None  # the downstream's refusal code, if any
    #: the fault of our own configuration it was rejected for (states.ConfigFault), if any
    fault: str | None = None
    reference: str | None = None  # the receipt's downstream reference
    receipt_status: str | None = None  # the receipt's own status ("succeeded", "rejected")
    in_review: bool = False
    compensates: str | None = None  # op_id of the operation this one offsets
    sent: bool = False  # an attempt was made (an attempt row exists)
    by_staff: bool = False  # settled by support staff's statement, not a downstream record
    #: the downstream's record differs from the intent (a receipt mismatch staff settled)
    differs: bool = False
    #: what the "not found" that proved an attempt had no effect rested on: ``deadline_fence``
    #: (the service refuses late requests) or ``delay_bound`` (none lands later than
    #: ``max_request_delay_seconds``); None where no "not found" proved anything
    rests_on: str | None = None
    max_request_delay_seconds: float | None = None
    #: the intent's amount, in minor units of ``currency`` (None for a kind without one)
    amount_minor: int | None = None
    currency: str | None = None
    #: a ``not_executed`` rejection: where its tries stopped (None where it was not tried)
    stopped: Stopped | None = None
    #: an uncertain one: what it waits for and the latest it is decided by
    #: (``outbox.verdict_due``; None where the reader was not given the reconciler's numbers)
    due: VerdictDue | None = None


@dataclass(frozen=True)
class CompensationNote:
    op_id: str
    status: Compensation
    reference: str | None


@dataclass(frozen=True)
class Line:
    """One operation in the report: its group, a message key and the evidence it rests on."""

    op_id: str
    kind: str
    state: State
    group: Group
    message: str  # key into the message tables
    evidence: Mapping[str, Any]
    compensates: str | None = None
    compensation: CompensationNote | None = None
    amount_minor: int | None = None
    currency: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "kind": self.kind,
            "state": self.state.value,
            "group": self.group.value,
            "message": self.message,
            "evidence": dict(self.evidence),
            "compensates": self.compensates,
            "amount_minor": self.amount_minor,
            "currency": self.currency,
            "compensation": None
            if self.compensation is None
            else {
                "op_id": self.compensation.op_id,
                "status": self.compensation.status.value,
                "reference": self.compensation.reference,
            },
        }


def group_of(state: State) -> Group:
    if state is State.SUCCEEDED:
        return Group.DONE
    if state in (State.SUBMITTED, State.UNKNOWN):
        return Group.UNCERTAIN
    return Group.NOT_DONE  # planned (not sent yet), rejected, cancelled


def build_line(op: OpFacts, compensations: Iterable[OpFacts] = (), *, cancelled: bool) -> Line:
    """The report line of one operation (``compensations``: the operations offsetting it)."""
    group = group_of(op.state)
    evidence: dict[str, Any] = {}
    if op.state is State.SUCCEEDED:
        message = "done" if op.reference else "done_no_receipt"
        if op.by_staff:
            message = "done_staff"
        elif op.differs:
            message = "done_differs"
        evidence["reference"] = op.reference
    elif op.state is State.REJECTED:
        message = "rejected_staff" if op.by_staff else "rejected"
        evidence["reason"] = op.reason
        if op.reason == "not_executed" and op.sent:
            evidence["reason"] = "not_executed_sent"  # sent, and proven not carried out
        if op.fault and not op.by_staff:
            evidence["reason"] = op.fault  # the true stop: our credentials, our keys
        else:
            evidence.update(_stop_evidence(op))
        if op.code:
            evidence["code"] = op.code
    elif op.state is State.CANCELLED:
        message = "cancelled_after_check" if op.sent else "cancelled"
    elif op.state is State.PLANNED:
        message = "planned_stopped" if cancelled else "planned"
        if op.sent:
            message += "_again"
    else:
        message = "pending_stopped" if cancelled else "pending"
        if op.in_review:
            message += "_review"
        if op.due is not None:
            evidence.update(op.due.as_evidence())  # waits_for, verdict_by (ISO)
    if group is Group.NOT_DONE and op.rests_on is not None and _for_want_of_proof(op):
        # "had no effect" was proven by a "not found", on an assumption: say which
        evidence["rests_on"] = op.rests_on
        if op.rests_on == "delay_bound":
            evidence["max_request_delay_seconds"] = op.max_request_delay_seconds
    evidence["in_review"] = op.in_review
    if op.compensates is not None:
        message = "compensation_" + message
    return Line(
        op_id=op.op_id,
        kind=op.kind,
        state=op.state,
        group=group,
        message=message,
        evidence=evidence,
        compensates=op.compensates,
        compensation=compensation_note(compensations),
        amount_minor=op.amount_minor,
        currency=op.currency,
    )


def _stop_evidence(op: OpFacts) -> dict[str, Any]:
    """The true stop of a ``not_executed`` rejection that was tried: which limit ended its
    tries, how many over how long, and what the service did to them."""
    stopped = op.stopped
    if op.reason != "not_executed" or op.by_staff or stopped is None:
        return {}
    if stopped.stop not in STOPS or stopped.tries < 1:
        return {}
    return {
        "stop": stopped.stop,
        "tries": stopped.tries,
        "reached": stopped.reached,
        "seconds": stopped.seconds,
        "cause": stopped.cause(),
        "status": stopped.last_status,
    }


def _for_want_of_proof(op: OpFacts) -> bool:
    """Not done with no definite refusal to show for it: sent, then not carried out in time,
    cancelled, stopped or waiting to be tried again."""
    if op.state is State.REJECTED:
        return op.reason == "not_executed" and not op.by_staff
    return op.sent


def _status(op: OpFacts) -> Compensation:
    if op.state is State.SUCCEEDED:
        if op.by_staff:
            return Compensation.STAFF
        # "Restored" needs the compensation's own receipt, saying it succeeded.
        if op.reference and op.receipt_status == "succeeded":
            return Compensation.RESTORED
        return Compensation.PENDING
    if op.state in (State.SUBMITTED, State.UNKNOWN):
        return Compensation.PENDING
    if op.state is State.PLANNED:
        return Compensation.PENDING if op.sent else Compensation.NOT_SENT
    return Compensation.NOT_DONE


def compensation_note(compensations: Iterable[OpFacts]) -> CompensationNote | None:
    """The best standing among an operation's compensations (the latest on a tie)."""
    best: tuple[int, OpFacts, Compensation] | None = None
    order = list(Compensation)
    for op in compensations:
        status = _status(op)
        rank = order.index(status)
        if best is None or rank <= best[0]:
            best = (rank, op, status)
    if best is None:
        return None
    _, op, status = best
    shown = status in (Compensation.RESTORED, Compensation.STAFF)
    return CompensationNote(op.op_id, status, op.reference if shown else None)
