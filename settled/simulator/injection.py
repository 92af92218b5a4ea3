"""What the fault drawn for a request does to it, phase by phase (docs/wire-protocol.md, "Faults").

- before the idempotency layer, saving nothing: ``429``, ``403``, ``503_before``,
  ``reset_before``;
- with the key in flight, before executing: ``hold_before_commit``;
- in the execution, saved and replayed: ``business_reject``, ``mismatched_receipt``,
  ``503_after_commit``;
- in the execution, saved and replayed, with no effect: ``500_saved``;
- on the answer, replays too: ``commit_then_timeout``, ``commit_then_reset``, ``slow_body``
  (the body written one byte per ``hold_seconds``);
- on a lookup: ``lookup_unavailable``.

A fault is counted as injected (``GET /_control/faults`` "injected") when it acts, never when it
is only drawn: a ``503_after_commit`` drawn for a replay, for one, finds nothing to act on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from outbox import wire
from outbox.kinds import Kind
from settled.simulator.faults import Fault, Rule
from settled.simulator.ledger import Scripted
from settled.simulator.messages import Answer, Connection, Response, error
from settled.simulator.state import Simulator

DEFAULT_HOLD_SECONDS = 30.0
#: ``slow_body``: the pause before each byte of the body where the rule names none.
DEFAULT_PACE_SECONDS = 0.5
#: ``code`` of the ``403`` fault's permission error.
PERMISSION_DENIED = "permission_denied"

_UNSCRIPTED = Scripted()


class Injection:
    """The fault drawn for one request (``rule``, None for none) and its effect in each phase."""

    __slots__ = ("_connection", "_sim", "rule")

    def __init__(self, sim: Simulator, rule: Rule | None, connection: Connection) -> None:
        self._sim = sim
        self._connection = connection
        self.rule = rule

    def before_idempotency(self) -> None:
        """``429``, ``403``, ``503_before``: answer at once; ``reset_before``: reset. Nothing is
        saved."""
        rule = self.rule
        if rule is None:
            return
        if rule.fault is Fault.RATE_LIMITED:
            self._sim.note_injected(rule.fault)
            raise Answer(
                error(
                    429,
                    wire.RATE_LIMIT_ERROR,
                    "rate_limited",
                    "too many requests",
                    {wire.RETRY_AFTER: rule.retry_after or "1"},
                )
            )
        if rule.fault is Fault.FORBIDDEN:
            self._sim.note_injected(rule.fault)
            raise Answer(
                error(403, wire.PERMISSION_ERROR, PERMISSION_DENIED, "this key may not do this")
            )
        if rule.fault is Fault.UNAVAILABLE_BEFORE:
            self._sim.note_injected(rule.fault)
            raise Answer(
                error(503, wire.API_ERROR, wire.NOT_PROCESSED, "unavailable; nothing was processed")
            )
        if rule.fault is Fault.RESET_BEFORE:
            self._sim.note_injected(rule.fault)
            self._connection.reset()

    def before_commit(self) -> None:
        """``hold_before_commit``: hold, the key in flight, before executing."""
        rule = self.rule
        if rule is not None and rule.fault is Fault.HOLD_BEFORE_COMMIT:
            self._sim.note_injected(rule.fault)
            self._sim.hold(self._connection, rule.hold_seconds or DEFAULT_HOLD_SECONDS)

    @contextmanager
    def in_execution(self, kind: Kind) -> Iterator[Scripted]:
        """What ``business_reject``, ``mismatched_receipt`` and ``503_after_commit`` change in
        the execution run in the ``with`` block; counted once it has run."""
        rule = self.rule
        fault = rule.fault if rule is not None else None
        if rule is None or fault not in _IN_EXECUTION:
            yield _UNSCRIPTED
            return
        yield Scripted(
            refusal_code=(rule.code or "declined") if fault is Fault.BUSINESS_REJECT else None,
            wrong_field=(rule.field or _default_field(kind))
            if fault is Fault.MISMATCHED_RECEIPT
            else None,
            answer_503=fault is Fault.UNAVAILABLE_AFTER_COMMIT,
            error_before_effect=fault is Fault.SAVED_500,
        )
        self._sim.note_injected(rule.fault)

    def on_answer(self, response: Response) -> Response:
        """``commit_then_timeout``: hold the answer, then reset (answer late if a test releases
        the hold); ``commit_then_reset``: reset instead of answering."""
        rule = self.rule
        if rule is None or rule.fault not in _ON_ANSWER:
            return response
        self._sim.note_injected(rule.fault)
        if rule.fault is Fault.COMMIT_THEN_TIMEOUT:
            held = self._sim.hold(self._connection, rule.hold_seconds or DEFAULT_HOLD_SECONDS)
            if held != "released":  # otherwise the client never hears
                self._connection.reset()
        if rule.fault is Fault.COMMIT_THEN_RESET:
            self._connection.reset()
        if rule.fault is Fault.SLOW_BODY:
            return replace(response, pace=rule.hold_seconds or DEFAULT_PACE_SECONDS)
        return response

    def on_lookup(self) -> None:
        """``lookup_unavailable``: the lookup answers 503."""
        rule = self.rule
        if rule is not None and rule.fault is Fault.LOOKUP_UNAVAILABLE:
            self._sim.note_injected(rule.fault)
            raise Answer(error(503, wire.API_ERROR, "lookup_unavailable", "lookup is unavailable"))


_IN_EXECUTION = frozenset(
    {
        Fault.BUSINESS_REJECT,
        Fault.MISMATCHED_RECEIPT,
        Fault.UNAVAILABLE_AFTER_COMMIT,
        Fault.SAVED_500,
    }
)
_ON_ANSWER = frozenset({Fault.COMMIT_THEN_TIMEOUT, Fault.COMMIT_THEN_RESET, Fault.SLOW_BODY})


def _default_field(kind: Kind) -> str:
    fields = list(kind.intent.model_fields)
    return "amount_minor" if "amount_minor" in fields else fields[-1]
