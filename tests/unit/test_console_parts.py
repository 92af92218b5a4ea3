"""The console's pure parts: the string catalogue, the chart's geometry, the choices a
lookup allows, the per-minute buckets and the formats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from settled.console.chart import HEIGHT, WIDTH, chart
from settled.console.formats import age, amount, who
from settled.console.text import CATALOGUE, lang_of, translate
from support.evidence import Choice, allowed_choices
from support.overview import per_minute


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


def test_chart_bars_scale_to_the_tallest_and_the_line_skips_empty_minutes() -> None:
    drawn = chart([0, 2, 4], [None, 10.0, 5.0])
    assert [b.height for b in drawn.bars] == [0.0, HEIGHT / 2, HEIGHT]
    assert [b.y for b in drawn.bars] == [HEIGHT, HEIGHT / 2, 0.0]
    assert drawn.bars[2].x == round(2 * WIDTH / 3, 2)
    step = WIDTH / 3
    first, second = f"{round(step * 1.4, 2)},0.0", f"{round(step * 2.4, 2)},{HEIGHT / 2}"
    assert drawn.line == f"{first} {second}"
    assert (drawn.max_count, drawn.max_seconds) == (4, 10.0)


def test_an_empty_chart_draws_flat() -> None:
    drawn = chart([0] * 60, [None] * 60)
    assert all(b.height == 0 for b in drawn.bars) and drawn.line == ""


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
