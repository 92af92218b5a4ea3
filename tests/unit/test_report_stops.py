"""A rejection whose tries were given up says its true stop: the limit that ended them (the
deadline, the attempt budget, a Retry-After too long, the ceiling on tries), how many tries
over how long, and what the service did to them; never "not carried out in time" for a
refund given up an hour before its deadline (finding 1 of issue 28)."""

from __future__ import annotations

import pytest

from outbox.report import render_line
from outbox.report_lines import OpFacts, Stopped, build_line
from outbox.report_text import MESSAGES
from outbox.retry import STOPS
from outbox.states import State

REFUSED = {"last_proof": "not_sent", "last_phase": "connect", "last_detail": "ConnectError"}
TIMED_OUT = {"last_proof": "not_sent", "last_phase": "connect", "last_detail": "ConnectTimeout"}
BUSY = {"last_proof": "not_executed", "last_status": 429}
UNAVAILABLE = {"last_proof": "not_executed", "last_status": 503}


def line(stopped: Stopped | None, lang: str = "en", **facts: object) -> str:
    op = OpFacts(
        "op-9", "refund", State.REJECTED, reason="not_executed", sent=True, stopped=stopped,
        **facts,  # type: ignore[arg-type]
    )  # fmt: skip
    return render_line(build_line(op, cancelled=False), False, lang)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stopped", "en", "zh"),
    [
        (
            Stopped("deadline_passed", 9, 0, 14 * 60 + 10, **REFUSED),  # type: ignore[arg-type]
            "gave up at its deadline after 9 tries over 14 min (the service refused connections)",
            "已到截止时间，放弃重试：共尝试 9 次，历时 14 分钟（对方服务拒绝连接）",
        ),
        (
            Stopped("deadline_passed", 3, 0, 40.2, **TIMED_OUT),  # type: ignore[arg-type]
            "gave up at its deadline after 3 tries over 40 s (the service could not be reached)",
            "已到截止时间，放弃重试：共尝试 3 次，历时 40 秒（无法连接对方服务）",
        ),
        (
            Stopped("attempts_exhausted", 7, 5, 125.0, **UNAVAILABLE),  # type: ignore[arg-type]
            "gave up after 7 tries over 2 min, all the attempts it was allowed (5) spent "
            "without effect (the service declined to process it, HTTP 503)",
            "放弃重试：共尝试 7 次，历时 2 分钟，允许的 5 次尝试均已用完且未生效"
            "（对方服务未处理该请求，HTTP 503）",
        ),
        (
            Stopped("retry_after_past_deadline", 1, 1, 0.2, **BUSY),  # type: ignore[arg-type]
            "gave up after 1 try within a second; the service asked to wait past its deadline",
            "放弃重试：共尝试 1 次，历时不到 1 秒；对方服务要求等待的时间超过了截止时间",
        ),
        (
            Stopped("tries_exhausted", 1000, 0, 3 * 3600.0, **REFUSED),  # type: ignore[arg-type]
            "gave up after 1000 tries over 3 h, the most tries allowed (the service refused "
            "connections)",
            "放弃重试：共尝试 1000 次，历时 3 小时，已达尝试次数上限（对方服务拒绝连接）",
        ),
    ],
)
def test_a_give_up_says_its_true_stop_in_both_languages(stopped: Stopped, en: str, zh: str) -> None:
    assert line(stopped) == f"Operation op-9 (refund) was not done: {en}."
    assert line(stopped, "zh") == f"操作 op-9（refund）未完成：{zh}。"


def test_every_stop_of_the_retry_budget_has_its_sentence() -> None:
    for lang in ("en", "zh"):
        for stop in STOPS:
            assert f"stop.{stop}" in MESSAGES[lang]
            text = line(Stopped(stop, 2, 1, 90.0, **REFUSED), lang)  # type: ignore[arg-type]
            assert "{" not in text and "not carried out" not in text


def test_the_line_carries_the_stop_as_evidence() -> None:
    op = OpFacts(
        "op-9", "refund", State.REJECTED, reason="not_executed", sent=True,
        stopped=Stopped("deadline_passed", 9, 0, 840.0, **REFUSED),  # type: ignore[arg-type]
    )  # fmt: skip
    evidence = build_line(op, cancelled=False).evidence
    assert {k: evidence[k] for k in ("stop", "tries", "reached", "cause")} == {
        "stop": "deadline_passed",
        "tries": 9,
        "reached": 0,
        "cause": "refused",
    }


@pytest.mark.parametrize(
    "facts",
    [
        {"stopped": None},  # not tried (given up before its first send), or an older row
        {"stopped": Stopped("key_retention_passed", 3, 1, 60.0)},  # not a stop of the budget
        {"stopped": Stopped("deadline_passed", 0, 0, None)},  # no try made
        {"stopped": Stopped("deadline_passed", 3, 0, 60.0), "by_staff": True},
    ],
)
def test_without_a_budget_stop_the_reason_is_said_as_before(facts: dict[str, object]) -> None:
    stopped = facts.pop("stopped")
    text = line(stopped, **facts)  # type: ignore[arg-type]
    assert "gave up" not in text
