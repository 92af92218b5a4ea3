"""The approvals model: the real rules hold in every interleaving of the CI configurations,
and every broken variant is caught with a trace."""

from __future__ import annotations

import pytest

from tests.model.approvals import CONFIGURATIONS, VARIANTS, ApprovalsModel, World
from tests.model.engine import explore

#: the property each broken variant must break
BROKEN = {
    "intake without the shared lock": "a second refund is never approved by the policy alone",
    "policy without the exclusive lock": "a second refund is never approved by the policy alone",
    "policy ignores the app's refunds": "a second refund is never approved by the policy alone",
    "approval not conditional on the status": (
        "no approval of a declined, withdrawn or expired proposal",
        "each proposal approved at most once",
    ),
    "approval ignores the time to live": "no approval of a declined, withdrawn or expired proposal",
}


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_the_real_rules_hold_in_every_interleaving(name: str) -> None:
    result = explore(CONFIGURATIONS[name])
    print(result.figures.line())
    assert result.violation is None, result.violation.render()
    assert result.figures.exhaustive
    assert result.figures.states > 100  # not a model that stops at its first step


def test_every_variant_is_named_with_the_property_it_breaks() -> None:
    assert set(VARIANTS) == set(BROKEN)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_broken_variant_is_caught_with_a_trace(name: str) -> None:
    result = explore(VARIANTS[name])
    print(result.figures.line())
    assert result.violation is not None, f"{name}: not caught"
    print(result.violation.render())
    assert result.violation.property in BROKEN[name]
    assert result.figures.exhaustive or result.violation is not None


def reachable(model: ApprovalsModel) -> list[World]:
    """Every state of ``model`` (a small breadth-first walk of its own)."""
    seen: dict[World, None] = {}
    todo = list(model.initial())
    while todo:
        w = todo.pop()
        if w in seen:
            continue
        seen[w] = None
        todo.extend(nxt for _, nxt in model.successors(w))
    return list(seen)


def test_the_model_reaches_each_way_a_proposal_ends() -> None:
    """Not vacuous: the policy approves (the app's refund rolled back, or enqueued after the
    policy's commit), a person approves (the app's refund committed first), a proposal is
    declined, and one expires."""
    model = CONFIGURATIONS["approvals: agent and app"]
    settled = [w for w in reachable(model) if model.settled(w)]
    ends = {(w.hist[0], w.ops) for w in settled}
    assert (("approved@policy",), ("p0",)) in ends  # the app rolled back
    assert (("approved@policy",), ("app", "p0")) in ends  # the app came after
    assert (("approved@human-a",), ("app", "p0")) in ends
    assert (("approved@staff",), ("app", "p0")) in ends
    assert (("declined@human-a",), ("app",)) in ends
    assert (("expired@sweeper",), ("app",)) in ends


def test_the_policy_asks_a_person_for_the_second_of_two_agents_refunds() -> None:
    model = CONFIGURATIONS["approvals: two agents"]
    ends = {w.hist for w in reachable(model) if model.settled(w)}
    assert (("approved@policy",), ("approved@human-b",)) in ends
    assert (("approved@staff",), ("approved@policy",)) in ends
    assert not any(h == (("approved@policy",), ("approved@policy",)) for h in ends)
