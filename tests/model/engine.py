"""The explorer: breadth-first search over a model's states, with invariants and a trace.

A model is any object with the ``Model`` protocol's members. States must be hashable and
immutable (frozen dataclasses, tuples, frozensets); a step's label says who did what and with
which decision inputs and output, and is what a counterexample's trace prints.

Two properties are checked:

- **safety**: each ``Invariant`` holds in every reachable state (the first violation found is
  one at the least depth, since the search is breadth first);
- **settlement** (liveness under fair scheduling, in its usual finite-state form "always
  eventually possible"): from every reachable state some state the model calls ``settled`` is
  reachable. A state from which none is reachable is reported with the trace that leads to it.

The search is bounded by ``max_states`` and ``max_depth``; a run that hit a bound says so in
its figures (``Figures.exhaustive`` is False), and settlement is then not judged for states at
the frontier.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Step:
    """One transition: ``actor`` did ``action``; ``detail`` holds the decision's inputs and
    output (printed in traces)."""

    actor: str
    action: str
    detail: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.detail)
        return f"{self.actor}: {self.action}" + (f" ({extra})" if extra else "")


@dataclass(frozen=True)
class Invariant:
    """A property of every reachable state: ``check`` returns None when it holds, else why
    not (one line)."""

    name: str
    check: Callable[[Any], str | None]


class Model(Protocol):
    name: str

    def initial(self) -> Iterable[Hashable]: ...

    def successors(self, state: Any) -> Iterable[tuple[Step, Hashable]]: ...

    def invariants(self) -> Sequence[Invariant]: ...

    def settled(self, state: Any) -> bool: ...

    def describe(self, state: Any) -> str: ...


@dataclass
class Violation:
    model: str
    property: str
    why: str
    trace: list[tuple[Step | None, Any]]
    describe: Callable[[Any], str] = field(repr=False, default=str)

    def render(self) -> str:
        lines = [f"VIOLATION in {self.model}: {self.property}: {self.why}", "trace:"]
        for n, (step, state) in enumerate(self.trace):
            head = "initial" if step is None else str(step)
            lines.append(f"  {n:3d}. {head}")
            lines.extend(f"         {line}" for line in self.describe(state).splitlines())
        return "\n".join(lines)


@dataclass
class Figures:
    model: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    exhaustive: bool = True

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        kind = "exhaustive" if self.exhaustive else "bounded"
        return (
            f"{self.model}: {self.states} states, {self.transitions} transitions, depth "
            f"{self.depth}, {self.seconds:.1f} s ({self.states_per_second:,.0f} states/s), {kind}"
        )


@dataclass
class Result:
    figures: Figures
    violation: Violation | None


def explore(
    model: Model,
    *,
    max_states: int = 2_000_000,
    max_depth: int = 10_000,
    check_settlement: bool = True,
) -> Result:
    """Every state reachable from the model's initial states (up to the bounds), each checked."""
    started = time.monotonic()
    figures = Figures(model.name)
    invariants = list(model.invariants())
    parent: dict[Hashable, tuple[Hashable | None, Step | None]] = {}
    depth: dict[Hashable, int] = {}
    edges: dict[Hashable, list[Hashable]] = {}
    queue: deque[Hashable] = deque()

    def trace(state: Hashable) -> list[tuple[Step | None, Any]]:
        out: list[tuple[Step | None, Any]] = []
        at: Hashable | None = state
        while at is not None:
            before, step = parent[at]
            out.append((step, at))
            at = before
        return out[::-1]

    def done(violation: Violation | None) -> Result:
        figures.seconds = time.monotonic() - started
        figures.states = len(parent)
        return Result(figures, violation)

    def broken(state: Hashable) -> Violation | None:
        for inv in invariants:
            why = inv.check(state)
            if why is not None:
                return Violation(model.name, inv.name, why, trace(state), model.describe)
        return None

    for state in model.initial():
        if state not in parent:
            parent[state] = (None, None)
            depth[state] = 0
            queue.append(state)
            if (v := broken(state)) is not None:
                return done(v)
    frontier: set[Hashable] = set()
    while queue:
        state = queue.popleft()
        d = depth[state]
        figures.depth = max(figures.depth, d)
        if d >= max_depth or len(parent) >= max_states:
            figures.exhaustive = False
            frontier.add(state)
            continue
        nexts: list[Hashable] = []
        for step, nxt in model.successors(state):
            figures.transitions += 1
            nexts.append(nxt)
            if nxt in parent:
                continue
            parent[nxt] = (state, step)
            depth[nxt] = d + 1
            if (v := broken(nxt)) is not None:
                return done(v)
            queue.append(nxt)
        edges[state] = nexts
    if check_settlement:
        # Backwards from the settled states (and the frontier, whose future is unknown): a
        # state that reaches none of them can never settle.
        reverse: dict[Hashable, list[Hashable]] = {}
        for src, dsts in edges.items():
            for dst in dsts:
                reverse.setdefault(dst, []).append(src)
        can = {s for s in parent if model.settled(s)} | frontier
        work = deque(can)
        while work:
            s = work.popleft()
            for before in reverse.get(s, ()):
                if before not in can:
                    can.add(before)
                    work.append(before)
        stuck = [s for s in parent if s not in can]
        if stuck:
            worst = min(stuck, key=lambda s: depth[s])
            why = "no continuation reaches a settled state (terminal or in review)"
            return done(Violation(model.name, "settlement", why, trace(worst), model.describe))
    return done(None)
