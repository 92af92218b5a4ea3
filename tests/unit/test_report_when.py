"""An uncertain line of the run report says what it waits for and the latest it is decided by,
in both languages, in UTC with the zone named; and in its evidence as a code and an ISO time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from outbox.report import RunFacts, build_report, render, render_line
from outbox.report_lines import OpFacts, build_line
from outbox.report_text import MESSAGES
from outbox.states import State
from outbox.verdict_due import VerdictDue, WaitsFor

BY = datetime(2026, 12, 6, 12, 5, 7, tzinfo=UTC)
SAID = {
    ("en", WaitsFor.LOOKUP): "Asking the service again; decided by 2026-12-06 12:05:07 UTC at "
    "the latest, or handed to support staff.",
    ("zh", WaitsFor.LOOKUP): "正在再次向对方服务查询；最迟于 2026-12-06 12:05:07 UTC 得出结论，"
    "或转交客服人员处理。",
    ("en", WaitsFor.QUIESCENCE): 'so that a "not found" can be trusted; decided by 2026-12-06 '
    "12:05:07 UTC at the latest",
    ("zh", WaitsFor.QUIESCENCE): "“未找到”的查询结果才可采信；最迟于 2026-12-06 12:05:07 UTC",
    ("en", WaitsFor.SEND): "Waiting for the service's answer to the send; decided by "
    "2026-12-06 12:05:07 UTC at the latest",
    ("zh", WaitsFor.SEND): "正在等待对方服务对本次发送的答复；最迟于 2026-12-06 12:05:07 UTC",
    ("en", WaitsFor.CLOCK_STEP): "Waiting out a step of the database's clock",
    ("zh", WaitsFor.CLOCK_STEP): "数据库时钟发生了跳变",
    ("en", WaitsFor.REVIEW): "it goes to support staff by 2026-12-06 12:05:07 UTC at the latest.",
    ("zh", WaitsFor.REVIEW): "最迟于 2026-12-06 12:05:07 UTC 转交客服人员处理。",
}


def pending(
    due: VerdictDue | None, *, state: State = State.UNKNOWN, review: bool = False
) -> OpFacts:
    return OpFacts(op_id="op-9", kind="refund", state=state, sent=True, in_review=review, due=due)


@pytest.mark.parametrize(("lang", "waits_for"), list(SAID))
def test_an_uncertain_line_says_what_it_waits_for_and_by_when(
    lang: str, waits_for: WaitsFor
) -> None:
    state = State.SUBMITTED if waits_for is WaitsFor.SEND else State.UNKNOWN
    line = build_line(pending(VerdictDue(waits_for, BY), state=state), cancelled=False)
    text = render_line(line, False, lang)
    assert SAID[lang, waits_for] in text
    assert text.startswith(MESSAGES[lang]["pending"].format(op="op-9", kind="refund"))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_in_review_it_promises_no_time(lang: str) -> None:
    line = build_line(pending(VerdictDue(WaitsFor.STAFF, None), review=True), cancelled=False)
    text = render_line(line, False, lang)
    assert text.endswith(MESSAGES[lang]["when.staff"])
    assert "UTC" not in text and "2026" not in text
    assert line.evidence["waits_for"] == "staff" and line.evidence["verdict_by"] is None


def test_the_time_is_said_in_utc_whatever_zone_it_came_in() -> None:
    east = BY.astimezone(timezone(timedelta(hours=8)))
    line = build_line(pending(VerdictDue(WaitsFor.LOOKUP, east)), cancelled=False)
    assert "2026-12-06 12:05:07 UTC" in render_line(line, False, "en")


def test_evidence_and_json_carry_the_code_and_the_iso_time() -> None:
    report = build_report(RunFacts("run_x", False, [pending(VerdictDue(WaitsFor.QUIESCENCE, BY))]))
    row = json.loads(json.dumps(report.as_dict("zh")))["uncertain"][0]
    assert row["evidence"]["waits_for"] == "quiescence"
    assert datetime.fromisoformat(row["evidence"]["verdict_by"]) == BY
    assert "2026-12-06 12:05:07 UTC" in row["text"]
    assert "2026-12-06 12:05:07 UTC" in render(report, "en")


def test_a_stopped_run_says_it_too() -> None:
    line = build_line(pending(VerdictDue(WaitsFor.LOOKUP, BY)), cancelled=True)
    text = render_line(line, True, "en")
    assert text.startswith("Stopped further processing")
    assert "decided by 2026-12-06 12:05:07 UTC at the latest" in text


@pytest.mark.parametrize("state", [State.SUCCEEDED, State.REJECTED, State.PLANNED])
def test_no_time_is_said_for_a_line_that_is_not_uncertain(state: State) -> None:
    facts = OpFacts(op_id="op-1", kind="refund", state=state, reference="re_1", due=None)
    line = build_line(facts, cancelled=False)
    assert "waits_for" not in line.evidence


def test_without_the_reconcilers_numbers_nothing_is_promised() -> None:
    line = build_line(pending(None), cancelled=False)
    assert "waits_for" not in line.evidence
    assert render_line(line, False, "en") == MESSAGES["en"]["pending"].format(
        op="op-9", kind="refund"
    )


def test_every_reason_code_has_words_in_both_languages() -> None:
    for waits_for in WaitsFor:
        for lang in ("en", "zh"):
            assert f"when.{waits_for.value}" in MESSAGES[lang]
