"""The model checker's explorer on toy models whose answers are known."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tests.model.engine import Invariant, Step, explore


@dataclass
class Counter:
    """Two counters, each stepped up to ``top``; optionally a trap state with no way out."""

    top: int
    bad: tuple[int, int] | None = None
    trap: bool = False
    name: str = "counter"

    def initial(self) -> Iterable[tuple[int, int]]:
        return [(0, 0)]

    def successors(self, s: tuple[int, int]) -> Iterable[tuple[Step, tuple[int, int]]]:
        a, b = s
        if self.trap and s == (1, 1):
            yield Step("x", "loop"), s
            return
        if a < self.top:
            yield Step("a", "inc", (("to", a + 1),)), (a + 1, b)
        if b < self.top:
            yield Step("b", "inc"), (a, b + 1)

    def invariants(self) -> Sequence[Invariant]:
        return [Invariant("not bad", lambda s: "bad state" if s == self.bad else None)]

    def settled(self, s: tuple[int, int]) -> bool:
        return s == (self.top, self.top)

    def describe(self, s: tuple[int, int]) -> str:
        return f"a={s[0]} b={s[1]}"


def test_every_state_is_explored_and_counted() -> None:
    result = explore(Counter(3))
    assert result.violation is None
    f = result.figures
    assert (f.states, f.transitions, f.depth, f.exhaustive) == (16, 24, 6, True)


def test_a_violation_is_a_shortest_trace_with_its_steps() -> None:
    result = explore(Counter(3, bad=(2, 1)))
    assert result.violation is not None
    v = result.violation
    assert v.property == "not bad" and len(v.trace) == 4  # initial + 3 steps: the least depth
    assert v.trace[0][0] is None and v.trace[-1][1] == (2, 1)
    text = v.render()
    assert "VIOLATION in counter: not bad: bad state" in text and "a: inc (to=1)" in text


def test_a_state_that_can_never_settle_is_found() -> None:
    result = explore(Counter(2, trap=True))
    assert result.violation is not None
    assert result.violation.property == "settlement"
    assert result.violation.trace[-1][1] == (1, 1)


def test_bounds_make_a_run_bounded_not_falsely_exhaustive() -> None:
    result = explore(Counter(50), max_states=100)
    assert result.violation is None and not result.figures.exhaustive
