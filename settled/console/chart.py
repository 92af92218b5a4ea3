"""The overview's small inline-SVG chart: bars of operations settled per minute, and a line
of the median time to settle. Pure geometry, so no chart library and no build step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 600
HEIGHT = 120


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int


@dataclass(frozen=True)
class Chart:
    bars: tuple[Bar, ...]
    #: the line's points, "x,y x,y ..." (minutes with nothing settled are left out)
    line: str
    max_count: int
    max_seconds: float


def chart(counts: Sequence[int], seconds: Sequence[float | None]) -> Chart:
    """Bars for ``counts`` scaled to the tallest, and a line for ``seconds`` scaled to the
    slowest, side by side in a ``WIDTH`` x ``HEIGHT`` box (y grows downwards, as in SVG)."""
    n = max(len(counts), 1)
    step = WIDTH / n
    top = max(counts, default=0) or 1
    bars = tuple(
        Bar(round(i * step, 2), round(HEIGHT - HEIGHT * c / top, 2), round(step * 0.8, 2),
            round(HEIGHT * c / top, 2), c)
        for i, c in enumerate(counts)
    )  # fmt: skip
    slowest = max((s for s in seconds if s is not None), default=0.0)
    scale = slowest or 1.0
    points = [
        f"{round(i * step + step * 0.4, 2)},{round(HEIGHT - HEIGHT * s / scale, 2)}"
        for i, s in enumerate(seconds)
        if s is not None
    ]
    return Chart(bars, " ".join(points), max(counts, default=0), slowest)
