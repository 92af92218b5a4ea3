"""``workers.failpoints.arm``: a failpoint raised (or paused at) in-process, once."""

from __future__ import annotations

import pytest

from workers.failpoints import FailpointHit, arm, failpoint


def test_an_armed_step_raises_there_once_and_other_steps_pass() -> None:
    with arm("after_send"):
        failpoint("after_claim")
        with pytest.raises(FailpointHit) as hit:
            failpoint("after_send")
        assert hit.value.step == "after_send"
        failpoint("after_send")  # fired once
    failpoint("after_send")


def test_an_armed_step_with_an_action_runs_it_instead_of_raising() -> None:
    ran: list[str] = []
    with arm("after_claim", lambda: ran.append("paused")):
        failpoint("after_claim")
        failpoint("after_claim")
    assert ran == ["paused"]


def test_a_failpoint_hit_is_no_exception_the_code_under_test_could_swallow() -> None:
    assert not issubclass(FailpointHit, Exception)


def test_an_unknown_step_is_refused() -> None:
    with pytest.raises(ValueError, match="no such failpoint"), arm("after_lunch"):
        pass
