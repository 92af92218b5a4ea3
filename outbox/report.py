"""The report of a run: what is done, what is not, what is still uncertain.

Pure: built from operation snapshots (states, reject reasons, receipt references, whether an
attempt was ever made) and nothing else, never from free text. Wording lives in one message
table per language. A line says "not sent" only when no attempt was ever made; "restored" only
when the compensation succeeded *and* carries the downstream's receipt; an outcome support
staff settled by their own statement (no downstream record) is reported as their statement.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, get_args

from outbox.errors import InvalidInput
from outbox.states import State

Lang = Literal["en", "zh"]
LANGS: tuple[str, ...] = get_args(Lang)


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
class OpFacts:
    """What the report may know about one operation."""

    op_id: str
    kind: str
    state: State
    reason: str | None = None  # reject reason (states.RejectReason)
    code: str | None = None  # the downstream's refusal code, if any
    reference: str | None = None  # the receipt's downstream reference
    receipt_status: str | None = None  # the receipt's own status ("succeeded", "rejected")
    in_review: bool = False
    compensates: str | None = None  # op_id of the operation this one offsets
    sent: bool = False  # an attempt was made (an attempt row exists)
    by_staff: bool = False  # settled by support staff's statement, not a downstream record
    #: the downstream's record differs from the intent (a receipt mismatch staff settled)
    differs: bool = False


@dataclass(frozen=True)
class RunFacts:
    handle: str
    cancelled: bool
    operations: Sequence[OpFacts]
    title: str | None = None
    cancel_requested_at: datetime | None = None


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "kind": self.kind,
            "state": self.state.value,
            "group": self.group.value,
            "message": self.message,
            "evidence": dict(self.evidence),
            "compensates": self.compensates,
            "compensation": None
            if self.compensation is None
            else {
                "op_id": self.compensation.op_id,
                "status": self.compensation.status.value,
                "reference": self.compensation.reference,
            },
        }


@dataclass(frozen=True)
class Report:
    handle: str
    cancelled: bool
    lines: tuple[Line, ...]
    title: str | None = None
    cancel_requested_at: datetime | None = None
    counts: Mapping[Group, int] = field(default_factory=dict)

    def group(self, group: Group) -> list[Line]:
        return [line for line in self.lines if line.group is group]

    def line(self, op_id: str) -> Line:
        for line in self.lines:
            if line.op_id == op_id:
                return line
        raise KeyError(op_id)

    def as_dict(self, lang: str | None = None) -> dict[str, Any]:
        """JSON-safe; with ``lang``, adds the rendered text and each line's sentence."""
        data: dict[str, Any] = {
            "handle": self.handle,
            "title": self.title,
            "cancelled": self.cancelled,
            "cancel_requested_at": (
                self.cancel_requested_at.isoformat() if self.cancel_requested_at else None
            ),
            "counts": {g.value: self.counts.get(g, 0) for g in Group},
        }
        language = check_lang(lang) if lang is not None else None
        for group in Group:
            rows = []
            for line in self.group(group):
                row = line.as_dict()
                if language is not None:
                    row["text"] = render_line(line, self.cancelled, language)
                rows.append(row)
            data[group.value] = rows
        if language is not None:
            data["lang"] = language
            data["text"] = render(self, language)
        return data


# -- building ------------------------------------------------------------------------------


def build_report(run: RunFacts) -> Report:
    """Group every operation of the run and attach what its compensations achieved."""
    by_original: dict[str, list[OpFacts]] = {}
    for op in run.operations:
        if op.compensates is not None:
            by_original.setdefault(op.compensates, []).append(op)
    lines = tuple(
        build_line(op, by_original.get(op.op_id, ()), cancelled=run.cancelled)
        for op in run.operations
    )
    counts = {g: sum(1 for line in lines if line.group is g) for g in Group}
    return Report(run.handle, run.cancelled, lines, run.title, run.cancel_requested_at, counts)


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
    )


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


# -- rendering -----------------------------------------------------------------------------

#: Every sentence of the report, per language. Placeholders: op, kind, ref, reason, code, of,
#: comp; counts: done, not_done, uncertain.
MESSAGES: dict[str, dict[str, str]] = {
    "en": {
        "title": "Run {handle}: {done} done, {not_done} not done, {uncertain} uncertain.",
        "stopped": "Stopped further processing at the user's request.",
        "heading.done": "Done:",
        "heading.not_done": "Not done:",
        "heading.uncertain": "Uncertain:",
        "none": "  (none)",
        "done": "Operation {op} ({kind}) is done (receipt {ref}).",
        "done_no_receipt": (
            "Operation {op} ({kind}) is recorded as done, without a downstream receipt."
        ),
        "done_staff": (
            "Operation {op} ({kind}) is recorded as done by support staff (reference {ref}); "
            "this is their statement, not a receipt from the service."
        ),
        "done_differs": (
            "Operation {op} ({kind}) was done by the service (receipt {ref}), but with other "
            "details than were asked for; support staff have checked it."
        ),
        "rejected": "Operation {op} ({kind}) was not done: {reason}{code}.",
        "rejected_staff": (
            "Operation {op} ({kind}) is recorded as not done by support staff; "
            "this is their statement, not a record from the service."
        ),
        "cancelled": "Operation {op} ({kind}) was cancelled before it was sent.",
        "cancelled_after_check": (
            "Operation {op} ({kind}) was cancelled; its earlier attempts were checked and had "
            "no effect."
        ),
        "planned": "Operation {op} ({kind}) has not been sent yet.",
        "planned_again": (
            "Operation {op} ({kind}) has not been done yet; its earlier attempts had no effect "
            "and it will be tried again."
        ),
        "planned_stopped": "Operation {op} ({kind}) was stopped before it was sent.",
        "planned_stopped_again": (
            "Operation {op} ({kind}) was stopped; its earlier attempts had no effect."
        ),
        "pending": "The result of operation {op} ({kind}) is still pending confirmation.",
        "pending_review": (
            "The result of operation {op} ({kind}) is still pending confirmation; "
            "support staff are checking it."
        ),
        "pending_stopped": (
            "Stopped further processing, but the result of operation {op} ({kind}) "
            "is still pending confirmation."
        ),
        "pending_stopped_review": (
            "Stopped further processing, but the result of operation {op} ({kind}) "
            "is still pending confirmation; support staff are checking it."
        ),
        "compensation_prefix": "Compensation of {of}: ",
        "code": " ({code})",
        "comp.restored": " Restored by compensation {comp} (receipt {ref}).",
        "comp.staff": (
            " Support staff recorded compensation {comp} as done (reference {ref}); this is "
            "their statement, not a receipt from the service."
        ),
        "comp.pending": " Compensation {comp} is still pending confirmation.",
        "comp.not_sent": " Compensation {comp} has not been sent yet.",
        "comp.not_done": " Compensation {comp} was not done, so nothing has been reversed.",
        "reason.business_rejected": "refused by the service",
        "reason.invalid_params": "the request was invalid",
        "reason.permission_denied": "not permitted",
        "reason.not_executed": "it could not be sent in time",
        "reason.not_executed_sent": "it was not carried out in time",
        "reason.None": "refused",
    },
    "zh": {
        "title": "任务 {handle}：已完成 {done} 项，未完成 {not_done} 项，待确认 {uncertain} 项。",
        "stopped": "已按用户要求停止继续处理。",
        "heading.done": "已完成：",
        "heading.not_done": "未完成：",
        "heading.uncertain": "待确认：",
        "none": "  （无）",
        "done": "操作 {op}（{kind}）已完成（回执 {ref}）。",
        "done_no_receipt": "操作 {op}（{kind}）记录为已完成，但没有下游回执。",
        "done_staff": (
            "客服人员将操作 {op}（{kind}）记录为已完成（参考号 {ref}）；"
            "这是客服人员的陈述，不是对方服务的回执。"
        ),
        "rejected": "操作 {op}（{kind}）未完成：{reason}{code}。",
        "rejected_staff": (
            "客服人员将操作 {op}（{kind}）记录为未完成；这是客服人员的陈述，不是对方服务的记录。"
        ),
        "done_differs": (
            "对方服务已执行操作 {op}（{kind}）（回执 {ref}），但执行内容与请求不同；"
            "客服人员已核查。"
        ),
        "cancelled": "操作 {op}（{kind}）在发送前已取消。",
        "cancelled_after_check": "操作 {op}（{kind}）已取消；此前的尝试经核实未生效。",
        "planned": "操作 {op}（{kind}）尚未发送。",
        "planned_again": "操作 {op}（{kind}）尚未完成；此前的尝试未生效，将再次尝试。",
        "planned_stopped": "操作 {op}（{kind}）在发送前已停止。",
        "planned_stopped_again": "操作 {op}（{kind}）已停止；此前的尝试未生效。",
        "pending": "操作 {op}（{kind}）的结果仍待确认。",
        "pending_review": "操作 {op}（{kind}）的结果仍待确认，客服人员正在核查。",
        "pending_stopped": "已停止继续处理，但操作 {op}（{kind}）的结果仍待确认。",
        "pending_stopped_review": (
            "已停止继续处理，但操作 {op}（{kind}）的结果仍待确认，客服人员正在核查。"
        ),
        "compensation_prefix": "{of} 的补偿：",
        "code": "（{code}）",
        "comp.restored": "已由补偿操作 {comp} 撤销，已恢复（回执 {ref}）。",
        "comp.staff": (
            "客服人员将补偿操作 {comp} 记录为已完成（参考号 {ref}）；"
            "这是客服人员的陈述，不是对方服务的回执。"
        ),
        "comp.pending": "补偿操作 {comp} 的结果仍待确认。",
        "comp.not_sent": "补偿操作 {comp} 尚未发送。",
        "comp.not_done": "补偿操作 {comp} 未完成，原操作未被撤销。",
        "reason.business_rejected": "被对方服务拒绝",
        "reason.invalid_params": "请求无效",
        "reason.permission_denied": "没有权限",
        "reason.not_executed": "未能及时发送",
        "reason.not_executed_sent": "未能及时执行",
        "reason.None": "被拒绝",
    },
}


def check_lang(lang: object) -> Lang:
    if lang == "en":
        return "en"
    if lang == "zh":
        return "zh"
    raise InvalidInput(f"lang must be one of {list(LANGS)}", code="unsupported_language")


def render_line(line: Line, cancelled: bool, lang: Lang) -> str:
    """One sentence (two with a compensation note) for ``line``."""
    m = MESSAGES[lang]
    key = line.message.removeprefix("compensation_")
    code = line.evidence.get("code")
    text = m[key].format(
        op=line.op_id,
        kind=line.kind,
        ref=line.evidence.get("reference"),
        reason=m[f"reason.{line.evidence.get('reason')}"],
        code=m["code"].format(code=code) if code else "",
    )
    if line.compensates is not None:
        text = m["compensation_prefix"].format(of=line.compensates) + text
    note = line.compensation
    if note is not None:
        text += m[f"comp.{note.status.value}"].format(comp=note.op_id, ref=note.reference)
    return text


def render(report: Report, lang: Lang) -> str:
    """The report as text: a summary line, then done / not done / uncertain."""
    m = MESSAGES[check_lang(lang)]
    out = [
        m["title"].format(
            handle=report.handle,
            **{g.value: report.counts.get(g, 0) for g in Group},
        )
    ]
    if report.cancelled:
        out.append(m["stopped"])
    for group in Group:
        out.append(m[f"heading.{group.value}"])
        lines = report.group(group)
        out += [f"  - {render_line(line, report.cancelled, lang)}" for line in lines]
        if not lines:
            out.append(m["none"])
    return "\n".join(out)
