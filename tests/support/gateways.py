"""Gateways for tests: a real gateway with a test's interleaving run at one exact point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from outbox.clock import Deadline
from outbox.downstream import DownstreamRequest, Gateway, LookupOutcome, SubmitOutcome, Unavailable


@dataclass
class Interposed:
    """Sends and looks up through ``inner``; runs ``before_submit`` (once) after the executor
    decided to send and before the request reaches ``inner``; runs ``after_lookup`` (once)
    after a lookup was answered and before the reconciler reads the answer; ``lookup_as``
    replaces what a lookup of a key answers; ``rewrite_submit`` replaces what a submit
    answered (after it really went out)."""

    inner: Gateway
    before_submit: Callable[[str], None] | None = None
    after_lookup: Callable[[LookupOutcome], None] | None = None
    lookup_as: dict[str, LookupOutcome] = field(default_factory=dict)
    rewrite_submit: Callable[[SubmitOutcome], SubmitOutcome] | None = None

    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        hook, self.before_submit = self.before_submit, None
        if hook is not None:
            hook(request.idempotency_key)
        outcome = self.inner.submit(request, deadline=deadline)
        return outcome if self.rewrite_submit is None else self.rewrite_submit(outcome)

    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        found = self.inner.lookup(request, deadline=deadline)
        found = self.lookup_as.get(request.idempotency_key, found)
        hook, self.after_lookup = self.after_lookup, None
        if hook is not None:
            hook(found)
        return found


class FakeMonotonic:
    """A monotonic clock a test moves by hand (a worker paused for as long as it likes)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class SlowLookups:
    """Sends and looks up through ``inner``; every lookup answers ``seconds`` after it starts,
    on ``clock`` (a test's monotonic clock, moved instead of slept): one whose deadline leaves
    less than that times out at its deadline (``Unavailable``; the question did reach
    ``inner``). ``after`` runs with the lookup's number (from 1) once it has answered, before
    its caller reads the answer. ``asked`` counts the lookups that reached ``inner``."""

    inner: Gateway
    clock: FakeMonotonic
    seconds: float
    after: Callable[[int], None] | None = None
    asked: int = 0

    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        return self.inner.submit(request, deadline=deadline)

    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        assert isinstance(deadline, Deadline)
        left = deadline.left()
        found = self.inner.lookup(request, deadline=deadline)
        if left <= 0:
            return found  # not sent: ``inner`` saw the deadline gone
        self.asked += 1
        answer = found
        if left < self.seconds:
            answer = Unavailable("ReadTimeout")
        self.clock.advance(min(left, self.seconds))
        if self.after is not None:
            self.after(self.asked)
        return answer
