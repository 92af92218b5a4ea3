"""The console's pure parts: the string catalogue, the chart's geometry, the choices a
lookup allows, the per-minute buckets and the formats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.states import RejectReason, State
from settled.console.chart import LEFT, PLOT_HEIGHT, PLOT_WIDTH, TOP, chart, scale
from settled.console.formats import age, amount, who
from settled.console.text import CATALOGUE, lang_of, named, translate
from support.evidence import Choice, allowed_choices
from support.overview import per_minute
from support.staff import REASONS


def test_every_string_exists_in_both_languages() -> None:
    assert set(CATALOGUE["en"]) == set(CATALOGUE["zh"])
    assert translate("zh", "nav.review") == "待处理队列"
    assert translate("fr", "nav.review") == "Review queue"  # unknown language: English
    assert translate("en", "signed_in_as", staff="ann", role="support") == (
        "Signed in as ann (support)"
    )


@pytest.mark.parametrize(
    ("query", "cookie", "lang"),
    [("zh", None, "zh"), (None, "zh", "zh"), ("en", "zh", "en"), ("xx", "zh", "zh"),
     (None, None, "en"), ("<b>", None, "en")],
)  # fmt: skip
def test_the_language_is_the_querys_then_the_cookies(
    query: str | None, cookie: str | None, lang: str
) -> None:
    assert lang_of(query, cookie) == lang


def test_chart_bars_scale_to_a_round_top_and_the_lines_skip_empty_minutes() -> None:
    drawn = chart([0, 2, 4], [None, 10.0, 5.0], [None, 12.0, 7.0])
    assert drawn.settled.top == 4
    assert [b.height for b in drawn.bars] == [0.0, PLOT_HEIGHT / 2, PLOT_HEIGHT]
    assert [b.y for b in drawn.bars] == [TOP + PLOT_HEIGHT, TOP + PLOT_HEIGHT / 2, TOP]
    step = PLOT_WIDTH / 3
    assert drawn.bars[2].x == round(LEFT + 2 * step + step * 0.1, 2)
    assert drawn.seconds.top == 15  # the slowest (12 s, a p95) under a round top
    first = f"{round(LEFT + step * 1.5, 2)},{round(TOP + PLOT_HEIGHT - PLOT_HEIGHT * 10 / 15, 2)}"
    assert drawn.median_line.split() == [first, drawn.median_line.split()[1]]
    assert len(drawn.p95) == 2 and (drawn.max_count, drawn.max_seconds) == (4, 12.0)


def test_the_axes_tick_every_ten_minutes_ago_and_at_round_values() -> None:
    drawn = chart([0] * 59 + [7], [None] * 60)
    assert [t.label for t in drawn.settled.x_ticks] == ["50", "40", "30", "20", "10", "0"]
    assert drawn.settled.x_ticks[-1].at == pytest.approx(
        drawn.bars[-1].x + drawn.bars[-1].width / 2, abs=0.01
    )
    assert [t.label for t in drawn.settled.y_ticks] == ["0", "2", "4", "6", "8"]
    assert drawn.settled.y_ticks[0].at == TOP + PLOT_HEIGHT and drawn.settled.y_ticks[-1].at == TOP


@pytest.mark.parametrize(
    ("value", "whole", "top", "step"),
    [(0, True, 1, 1), (1, True, 1, 1), (3, True, 3, 1), (7, True, 8, 2), (12, True, 15, 5),
     (59, True, 60, 20), (0.35, False, 0.4, 0.1), (0.9, False, 1.0, 0.2), (250, False, 250, 50)],
)  # fmt: skip
def test_the_y_axis_has_a_round_top_in_at_most_five_steps(
    value: float, whole: bool, top: float, step: float
) -> None:
    assert scale(value, whole=whole) == pytest.approx((top, step))


def test_an_empty_chart_draws_flat() -> None:
    drawn = chart([0] * 60, [None] * 60)
    assert all(b.height == 0 for b in drawn.bars) and drawn.median_line == ""
    assert [t.label for t in drawn.seconds.y_ticks] == ["0", "1"]


def test_every_state_and_reason_has_a_name_in_both_languages() -> None:
    codes = [("state", s.value) for s in State] + [("reject", r.value) for r in RejectReason]
    codes += [("reason", r) for r in REASONS]
    for prefix, code in codes:
        assert f"{prefix}.{code}" in CATALOGUE["en"] and f"{prefix}.{code}" in CATALOGUE["zh"]
        assert named("zh", prefix, code) != named("en", prefix, code), code
    assert named("zh", "state", "unknown") == "结果未知"
    assert named("en", "reason", "lookup_unavailable") == "The service's lookup was unavailable"
    assert named("zh", "reason", "no_such_code") == "no_such_code"  # unknown: the code itself
    assert named("en", "state", None) == ""


S, R = Choice("succeeded"), Choice("rejected")
OS, OR = Choice("succeeded", True), Choice("rejected", True)


@pytest.mark.parametrize(
    ("lookup", "status", "boss", "choices"),
    [
        ("none", None, False, (S, R)),  # no lookup API: the staff's statement
        ("found", "succeeded", True, (S,)),
        ("found", "rejected", True, (R,)),
        ("mismatch", "succeeded", False, (S,)),
        ("mismatch", None, False, (S, R)),
        ("mismatch", None, True, (S, R, OS, OR)),
        ("not_found", None, False, (R,)),
        ("not_found", None, True, (R, OS, OR)),
        ("unavailable", None, False, ()),
        ("unavailable", None, True, (OS, OR)),
        ("pending", None, True, ()),  # taken on, not finished: not even an override
        (None, None, True, (OS, OR)),
    ],
)
def test_the_choices_the_last_lookup_allows(
    lookup: str | None, status: str | None, boss: bool, choices: tuple[Choice, ...]
) -> None:
    assert allowed_choices(lookup, status, may_override=boss) == choices


def test_settlements_are_bucketed_by_minute_with_their_median_time() -> None:
    end = datetime(2025, 5, 1, 12, 30, 40, tzinfo=UTC)
    made = end - timedelta(minutes=10)
    settled = [
        (end, end - timedelta(seconds=4)),
        (end - timedelta(seconds=30), end - timedelta(seconds=32)),
        (end - timedelta(seconds=50), end - timedelta(seconds=56)),  # the minute before
        (made - timedelta(hours=2), made - timedelta(hours=2)),  # outside the window
    ]
    minutes = per_minute(settled, end=end, minutes=60)
    assert len(minutes) == 60
    assert minutes[-1].start == datetime(2025, 5, 1, 12, 30, tzinfo=UTC)
    assert (minutes[-1].settled, minutes[-1].median_seconds) == (2, 3.0)
    assert (minutes[-2].settled, minutes[-2].median_seconds) == (1, 6.0)
    assert sum(m.settled for m in minutes) == 3
    assert minutes[0].median_seconds is None


def test_the_95th_percentile_is_a_time_that_occurred() -> None:
    end = datetime(2025, 5, 1, 12, 30, 59, tzinfo=UTC)
    settled = [(end, end - timedelta(seconds=s)) for s in [*range(1, 20), 100]]
    (minute,) = per_minute(settled, end=end, minutes=1)
    assert (minute.settled, minute.median_seconds, minute.p95_seconds) == (20, 10.5, 19.0)
    (one,) = per_minute(settled[:1], end=end, minutes=1)
    assert one.p95_seconds == 1.0 and per_minute([], end=end, minutes=1)[0].p95_seconds is None


def test_formats() -> None:
    assert amount(10000, "CNY") == "100.00 CNY"
    assert amount(500, "JPY") == "500 JPY"
    assert amount(1234, "KWD") == "1.234 KWD"
    assert amount(None, "CNY") == "" and amount(True, "CNY") == ""
    now = datetime(2025, 5, 1, tzinfo=UTC)
    assert age(now - timedelta(seconds=42), now) == "42 s"
    assert age((now - timedelta(hours=3, minutes=5)).isoformat(), now) == "3 h 5 min"
    assert age(now - timedelta(days=2, hours=4), now) == "2 d 4 h"
    assert (who("staff:ann"), who("reconciler:r1"), who(None)) == ("ann", "reconciler:r1", "")
