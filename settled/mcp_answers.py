"""What the MCP tools answer: a proposal's status in the run report's words, and errors as
tool results with a ``kind`` the model can act on (``settled.mcp_server``)."""

from __future__ import annotations

import json
from typing import Any, Literal

from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from outbox.kinds import AgentProfile
from outbox.models import Proposal
from outbox.proposals import APPROVED, PROPOSED, proposal_report
from outbox.report import render_line
from outbox.report_text import Lang
from outbox.verdict_due import Cadence

#: who withdraws a waiting proposal when the agent cancels it (``cancel_request``)
WITHDRAWN_BY = "agent:cancel"

ErrorKind = Literal["fixable", "permission", "business_rejected", "pending", "conflict"]

#: A proposal's status before it is an operation, per language (after: the run report's words);
#: ``{what}`` is the request's title (``AgentProfile.titles``).
WORDS: dict[str, dict[str, str]] = {
    "en": {
        "waiting_for_approval": "{what} {handle} is waiting for approval; nothing has been sent.",
        "declined": "{what} {handle} was declined; nothing was sent.",
        "withdrawn": "{what} {handle} was withdrawn before anyone decided; nothing was sent.",
        "expired": "{what} {handle} expired without a decision; nothing was sent.",
    },
    "zh": {
        "waiting_for_approval": "{what} {handle} 正在等待批准，尚未发送任何请求。",
        "declined": "{what} {handle} 已被拒绝，未发送任何请求。",
        "withdrawn": "{what} {handle} 在审批前已撤回，未发送任何请求。",
        "expired": "{what} {handle} 未获处理已过期，未发送任何请求。",
    },
}


class ToolAnswer(BaseModel):
    """A request as it stands: every tool's successful answer. An error answer has isError
    set and is {"error": {"kind", "message", "field"?, "handle"?}} instead."""

    model_config = ConfigDict(extra="allow")  # the kind's own terms (amount_minor, problem...)

    handle: str = Field(description="The request's handle: check its status with it.")
    kind: str = Field(description="refund, after_sales_ticket or ticket_cancel.")
    order_id: str | None = Field(description="The order the request is on.")
    decided_by: str | None = Field(description="Who approved or declined it (None: nobody).")
    status: Literal["waiting_for_approval", "declined", "withdrawn", "expired", "approved"]
    text: str = Field(description="What to tell the user, in the asked language.")
    op_id: str | None = Field(None, description="Once approved: the operation's id.")
    outcome: Literal["done", "not_done", "uncertain"] | None = Field(
        None, description="Once approved: done, not done, or uncertain (pending confirmation)."
    )
    state: str | None = Field(None, description="Once approved: the operation's state.")
    evidence: dict[str, Any] | None = Field(None, description="What the outcome rests on.")
    waits_for: Literal["send", "lookup", "quiescence", "clock_step", "review", "staff"] | None = (
        Field(
            None,
            description="Once approved and uncertain: what it waits for (staff: support staff "
            "decide, no time promised).",
        )
    )
    verdict_by: str | None = Field(
        None,
        description="Once approved and uncertain: the latest it is decided (settled, or handed "
        "to support staff), ISO 8601 in UTC; None while staff decide. Check again after it.",
    )
    stopped: bool | None = Field(None, description="Whether the request was stopped.")
    repeat: bool | None = Field(None, description="This call repeated an earlier request.")
    note: str | None = Field(None, description="Something the user must be told.")


class Refusal(BaseModel):
    """A tool's error (``{"error": ...}``, ``isError`` set): what kind, and what to fix."""

    model_config = ConfigDict(extra="allow")

    kind: ErrorKind
    message: str
    field: str | None = Field(None, description="The argument to fix (kind fixable).")
    handle: str | None = Field(None, description="The request it concerns, if one was made.")


def describe(
    session: Session,
    proposal: Proposal,
    lang: Lang,
    profile: AgentProfile,
    *,
    expired: bool = False,
    cadence: Cadence | None = None,
) -> dict[str, Any]:
    """A proposal as the status tool shows it: its terms (as its kind's ``profile`` shows
    them, and its order), and either where its approval stands or (once approved) its
    operation's line of the run report, with evidence. ``expired``: the proposal outlived its
    time to live (``Proposals.expired``), marked or not. With ``cadence`` (the reconciler's
    numbers), an uncertain one says what it waits for and the latest it is decided by
    (``waits_for``, ``verdict_by``: ``outbox.verdict_due``)."""
    params = proposal.params
    data: dict[str, Any] = {"handle": proposal.handle, "kind": proposal.kind}
    for name in profile.shown or tuple(params):
        data[profile.shown_as.get(name, name)] = params.get(name)
    if "order_id" not in data:  # a compensation's intent names no order: the original's
        data["order_id"] = proposal.order_ref
    data["decided_by"] = proposal.decided_by
    approved = proposal.status == APPROVED
    report = proposal_report(session, proposal, cadence=cadence) if approved else None
    if report is None or proposal.op_id is None:
        status = "waiting_for_approval" if proposal.status == PROPOSED else proposal.status
        if status == "declined" and proposal.decided_by == WITHDRAWN_BY:
            status = "withdrawn"  # nobody said no: the agent took it back
        if expired:
            status = "expired"
        what = profile.title(proposal.kind, lang)
        text = WORDS[lang][status].format(what=what, handle=proposal.handle)
        return {**data, "status": status, "text": text}
    line = report.line(proposal.op_id)
    due = {k: line.evidence[k] for k in ("waits_for", "verdict_by") if k in line.evidence}
    return {
        **data,
        **due,
        "status": "approved",
        "op_id": proposal.op_id,
        "outcome": line.group.value,
        "state": line.state.value,
        "evidence": dict(line.evidence),
        "stopped": report.cancelled,
        "text": render_line(line, report.cancelled, lang),
    }


def answer(data: dict[str, Any]) -> CallToolResult:
    """A tool's successful answer: structured, and the same as JSON text."""
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(data, ensure_ascii=False))],
        structuredContent=data,
    )


def refusal(kind: ErrorKind, message: str, **data: Any) -> CallToolResult:
    """A tool's error the model can act on: ``{"error": {"kind", "message", ...}}``."""
    error = {"kind": kind, "message": message, **data}
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps({"error": error}, ensure_ascii=False))],
        structuredContent={"error": error},
        isError=True,
    )
