"""The report of a run: what is done, what is not, what is still uncertain.

Pure: built from operation snapshots (``OpFacts``: states, reject reasons, receipt references,
whether an attempt was ever made) and nothing else, never from free text. This module holds the
run's report, how it is built from its operations' lines, and how it is rendered as text. One
operation's line, and the rules that group it, are ``outbox.report_lines``; the wording, one
message table per language, is ``outbox.report_text``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from outbox.currencies import format_amount
from outbox.report_lines import Group, Line, OpFacts, build_line
from outbox.report_text import MESSAGES, Lang, check_lang


@dataclass(frozen=True)
class RunFacts:
    handle: str
    cancelled: bool
    operations: Sequence[OpFacts]
    title: str | None = None
    cancel_requested_at: datetime | None = None


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


# -- rendering -----------------------------------------------------------------------------


def render_line(line: Line, cancelled: bool, lang: Lang) -> str:
    """One sentence (two with a compensation note) for ``line``."""
    m = MESSAGES[lang]
    key = line.message.removeprefix("compensation_")
    code = line.evidence.get("code")
    text = m[key].format(
        op=line.op_id,
        kind=_what(line, m),
        ref=line.evidence.get("reference"),
        reason=_reason(line.evidence, m),
        code=m["code"].format(code=code) if code else "",
    )
    rests_on = line.evidence.get("rests_on")
    if rests_on is not None:
        text += m[f"rests_on.{rests_on}"].format(
            delay=_duration(line.evidence.get("max_request_delay_seconds"), m)
        )
    waits_for = line.evidence.get("waits_for")
    if waits_for is not None:
        text += m[f"when.{waits_for}"].format(by=_clock(line.evidence.get("verdict_by")))
    if line.compensates is not None:
        text = m["compensation_prefix"].format(of=line.compensates) + text
    note = line.compensation
    if note is not None:
        text += m[f"comp.{note.status.value}"].format(comp=note.op_id, ref=note.reference)
    return text


def _clock(at: object) -> str:
    """An ISO time as people read it, in UTC with the zone named: "2026-12-03 06:14:16 UTC"
    (as the console writes exact times)."""
    if not isinstance(at, str):
        return ""
    moment = datetime.fromisoformat(at)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _what(line: Line, m: dict[str, str]) -> str:
    """The kind, with the amount where the intent has one: "refund of 100.00 CNY"."""
    amount = format_amount(line.amount_minor, line.currency)
    return m["kind_amount"].format(kind=line.kind, amount=amount) if amount else line.kind


def _reason(evidence: Mapping[str, Any], m: dict[str, str]) -> str:
    """Why it was not done: the reject reason, or for tries given up, their true stop
    ("gave up at its deadline after 9 tries over 14 min (the service refused connections)")."""
    stop = evidence.get("stop")
    if stop is None:
        return m[f"reason.{evidence.get('reason')}"]
    tries = evidence.get("tries")
    cause = evidence.get("cause")
    return m[f"stop.{stop}"].format(
        tries=m["tries.one" if tries == 1 else "tries.many"].format(n=tries),
        span=_span(evidence.get("seconds"), m),
        n=evidence.get("reached"),
        cause=m["cause"].format(text=m[f"cause.{cause}"].format(status=evidence.get("status")))
        if cause
        else "",
    )


def _span(seconds: object, m: dict[str, str]) -> str:
    """How long tries went on, roughly: "over 14 min", "within a second"."""
    if not isinstance(seconds, (int, float)):
        return m["span.unknown"]
    if seconds < 1:
        return m["span.short"]
    if seconds < 60:
        d = m["duration.s"].format(n=round(seconds))
    elif seconds < 7200:
        d = m["duration.min"].format(n=round(seconds / 60))
    else:
        d = m["duration.h"].format(n=round(seconds / 3600))
    return m["span.over"].format(d=d)


def _duration(seconds: object, m: dict[str, str]) -> str:
    """``300`` as "5 min", ``2`` as "2 s" (in the language of ``m``)."""
    if not isinstance(seconds, (int, float)):
        return m["duration.unknown"]
    if seconds >= 60 and seconds % 60 == 0:
        return m["duration.min"].format(n=int(seconds // 60))
    return m["duration.s"].format(n=f"{seconds:g}")


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
