"""A kind's downstream contract comes from the settings and is honoured by the worker, the
reconciler and the review queue alike (everything built by ``build_runtime``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from outbox.settings import Settings
from settled.runtime import Runtime, build_runtime
from support.staff import Staff
from tests.support.rig import HOLD, Rig


@pytest.fixture
def runtime(rig: Rig, settings: Settings, request: pytest.FixtureRequest) -> Iterator[Runtime]:
    contracts: dict[str, Any] = request.param
    configured = settings.model_copy(
        update={
            "database_url": rig.engine.url.render_as_string(hide_password=False),
            "downstream_url": rig.url,
            "downstream_api_keys": {rig.tenant.name: rig.tenant.api_key},
            "downstream_timeout": 1.0,
        }
    )
    # As an operator would write it: JSON in the environment, read by Settings.
    rt = build_runtime(
        Settings.model_validate({**configured.model_dump(), "downstream_contracts": contracts})
    )
    yield rt
    rt.close()


@pytest.mark.parametrize("runtime", [{"refund": {"idempotent": False}}], indirect=True)
def test_without_idempotency_an_ambiguous_send_is_never_sent_again(
    rig: Rig, runtime: Runtime
) -> None:
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    rig.control.set_switches(lookup_visibility_delay=3600)  # done, not visible yet
    op = rig.enqueue()
    runtime.executor.execute([op])
    assert rig.op(op).state == "unknown"
    assert runtime.reconciler.run_once().outcomes == {"to_review": 1}
    assert [r.reason for r in rig.reviews(op)] == ["ambiguous_without_idempotency"]
    rig.make_due(op)
    assert runtime.executor.execute([op]) == {}
    assert rig.sends(op) == 1
    # Once the downstream shows it, the lookup settles it truthfully.
    rig.control.set_switches(lookup_visibility_delay=0)
    rig.make_due(op)
    assert runtime.reconciler.run_once().outcomes == {"found": 1}
    assert rig.op(op).state == "succeeded"
    assert (rig.effects(op), rig.sends(op)) == (1, 1)


@pytest.mark.parametrize("runtime", [{"refund": {"queryable": False}}], indirect=True)
def test_without_a_lookup_an_ambiguous_send_is_settled_by_a_same_key_replay(
    rig: Rig, runtime: Runtime
) -> None:
    """Nothing to ask, but the downstream is idempotent: the same key sent again replays the
    first request's answer, and the refund is done once."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    runtime.executor.execute([op])
    assert runtime.reconciler.run_once().outcomes == {"resent": 1}
    assert rig.op(op).state == "succeeded"
    key = rig.op(op).idempotency_key
    assert (rig.effects(op), rig.sends(op)) == (1, 2)
    assert rig.control.requests("acme", key, phase="lookup") == 0


@pytest.mark.parametrize("runtime", [{"refund": {"queryable": False}}], indirect=True)
def test_without_a_lookup_an_ambiguous_send_no_replay_may_settle_goes_to_review(
    rig: Rig, runtime: Runtime
) -> None:
    """No lookup, and no resend allowed (its attempt budget is spent): review, and nothing is
    asked."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue(max_attempts=1)
    runtime.executor.execute([op])
    assert runtime.reconciler.run_once().outcomes == {"to_review": 1}
    (item,) = rig.reviews(op)
    assert item.reason == "no_lookup_replay_cannot_settle"
    key = rig.op(op).idempotency_key
    assert rig.control.requests("acme", key, phase="lookup") == 0
    # Staff settle it on their own evidence (there is no lookup to check it against).
    alice = Staff.parse("alice", "support")
    runtime.review.resolve(alice, item.id, outcome="succeeded", version=1, reference="bank-77")
    assert rig.op(op).receipt["source"] == "staff"  # type: ignore[index]
    assert rig.control.requests("acme", key, phase="lookup") == 0
