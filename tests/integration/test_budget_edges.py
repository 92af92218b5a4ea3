"""The send budget at its edge: the attempt that spends the last of ``max_attempts`` is judged
with itself counted, so a "not executed" answer to it ends the operation at once rather than
deferring it to a claim that the pre-send check then stops. On PostgreSQL and SQLite. Written
to kill a mutant the mutation suite let through (docs/mutation.md)."""

from __future__ import annotations

from outbox.kinds import default_registry
from outbox.states import State
from tests.support.rig import Rig


def test_the_last_attempt_of_the_budget_is_judged_with_itself_counted(rig: Rig) -> None:
    registry = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    op_id = rig.enqueue(max_attempts=1)
    rig.control.add_rule("503_before")
    assert rig.executor(registry).execute([op_id]) == {op_id: State.REJECTED}
    op = rig.op(op_id)
    assert (op.state, op.reason, op.attempts) == ("rejected", "not_executed", 1)
    assert rig.sends(op_id) == 1 and rig.effects(op_id) == 0


def test_an_attempt_inside_the_budget_is_deferred_not_given_up(rig: Rig) -> None:
    registry = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    op_id = rig.enqueue(max_attempts=2)
    rig.control.add_rule("503_before")
    assert rig.executor(registry).execute([op_id]) == {op_id: State.PLANNED}
    op = rig.op(op_id)
    assert (op.state, op.attempts) == ("planned", 1)  # one of two spent: tried again later
    assert rig.sends(op_id) == 1
