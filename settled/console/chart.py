"""The overview's two server-rendered SVG charts, as geometry: operations settled per minute
(bars) and the time they took to settle (median and 95th percentile, lines with a marker per
minute), each over the last hour with a labelled x axis (minutes ago) and y axis (a count, or
seconds) and round tick values. Pure, so no chart library, no script and no build step; the
template (``_chart.html``) draws it with CSS classes only (the console's CSP allows no inline
style), with a title, a description, a legend and the figures as a table.

Both charts share one frame: ``WIDTH`` x ``HEIGHT``, the plot inside the margins, y growing
downwards as in SVG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 640
HEIGHT = 230
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 40, 46
PLOT_WIDTH = WIDTH - LEFT - RIGHT
PLOT_HEIGHT = HEIGHT - TOP - BOTTOM
#: the x axis is labelled every this many minutes
X_EVERY = 10
#: at most this many steps up the y axis
Y_STEPS = 5


@dataclass(frozen=True)
class Frame:
    """Where the plot sits in each chart's box (what the template draws the axes along)."""

    width: float = WIDTH
    height: float = HEIGHT
    left: float = LEFT
    right: float = WIDTH - RIGHT
    top: float = TOP
    bottom: float = HEIGHT - BOTTOM


FRAME = Frame()


@dataclass(frozen=True)
class Tick:
    #: the x (x axis) or y (y axis) of the tick in the frame
    at: float
    label: str


@dataclass(frozen=True)
class Axes:
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    #: the value at the top of the y axis (a round number, at least the largest value)
    top: float


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    value: float


@dataclass(frozen=True)
class Chart:
    settled: Axes
    bars: tuple[Bar, ...]
    seconds: Axes
    median: tuple[Point, ...]
    p95: tuple[Point, ...]
    max_count: int
    max_seconds: float

    @property
    def median_line(self) -> str:
        """The median's points, "x,y x,y ..." (minutes with nothing settled are left out)."""
        return _line(self.median)

    @property
    def p95_line(self) -> str:
        return _line(self.p95)


def chart(
    counts: Sequence[int],
    median: Sequence[float | None],
    p95: Sequence[float | None] | None = None,
) -> Chart:
    """The two charts of ``counts`` (operations settled in each minute, oldest first; the last
    is the current minute) and ``median`` and ``p95`` (seconds to settle in each minute)."""
    n = max(len(counts), 1)
    step = PLOT_WIDTH / n
    p95 = p95 if p95 is not None else [None] * len(median)
    largest = max(counts, default=0)
    count_top, count_step = scale(largest, whole=True)
    bars = tuple(
        Bar(_r(LEFT + i * step + step * 0.1), _y(c, count_top), _r(step * 0.8),
            _r(PLOT_HEIGHT * c / count_top), c)
        for i, c in enumerate(counts)
    )  # fmt: skip
    slowest = max((s for s in [*median, *p95] if s is not None), default=0.0)
    seconds_top, seconds_step = scale(slowest, whole=False)

    def points(values: Sequence[float | None]) -> tuple[Point, ...]:
        return tuple(
            Point(_r(LEFT + (i + 0.5) * step), _y(v, seconds_top), v)
            for i, v in enumerate(values)
            if v is not None
        )

    x_ticks = _x_ticks(len(counts), step)
    return Chart(
        settled=Axes(x_ticks, _y_ticks(count_top, count_step), count_top),
        bars=bars,
        seconds=Axes(x_ticks, _y_ticks(seconds_top, seconds_step), seconds_top),
        median=points(median),
        p95=points(p95),
        max_count=largest,
        max_seconds=slowest,
    )


def scale(value: float, *, whole: bool) -> tuple[float, float]:
    """The y axis for a largest value ``value``: its top and its step. The step is 1, 2 or 5
    times a power of ten (whole for ``whole`` counts), the top the least multiple of it at
    least ``value``, at most ``Y_STEPS`` steps up; nothing at all is drawn up to 1."""
    if value <= 0:
        return 1.0, 1.0
    step = _step(value, whole=whole)
    return _r(math.ceil(value / step - 1e-9) * step, 6), step


def _step(value: float, *, whole: bool) -> float:
    power = 10.0 ** math.floor(math.log10(value / Y_STEPS))
    for multiple in (1, 2, 5, 10):
        step = multiple * power
        if whole:
            step = max(1.0, step)
        if value / step <= Y_STEPS + 1e-9:
            return step
    return 10 * power  # not reached: 10 x power always fits


def _x_ticks(n: int, step: float) -> tuple[Tick, ...]:
    """A tick every ``X_EVERY`` minutes, labelled with how many minutes ago (0: now)."""
    return tuple(
        Tick(_r(LEFT + (n - 1 - ago + 0.5) * step), str(ago))
        for ago in range(n - 1 - (n - 1) % X_EVERY, -1, -X_EVERY)
    )


def _y_ticks(top: float, step: float) -> tuple[Tick, ...]:
    steps = round(top / step)
    return tuple(
        Tick(_y(top * k / steps, top), f"{_r(top * k / steps, 6):g}") for k in range(steps + 1)
    )


def _y(value: float, top: float) -> float:
    return _r(TOP + PLOT_HEIGHT - PLOT_HEIGHT * value / top)


def _r(value: float, digits: int = 2) -> float:
    return round(value, digits)


def _line(points: Sequence[Point]) -> str:
    return " ".join(f"{p.x},{p.y}" for p in points)
