"""Steps of the database's clock: the detector as a table, on an injected monotonic clock."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from outbox.clock import DRIFT, Reading, StepDetector

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def detector() -> StepDetector:
    return StepDetector(margin=1.0, window=15.0)


#: (database advance, monotonic advance, each reading's round trip) -> step seen (seconds), or None
STEPS = {
    "steady": (10.0, 10.0, 0.0, None),
    "within_margin_ahead": (10.9, 10.0, 0.0, None),
    "within_margin_behind": (9.1, 10.0, 0.0, None),
    "slow_round_trip_is_not_a_step": (12.5, 10.0, 2.0, None),  # read late in a 2 s claim
    "forward": (40.0, 10.0, 0.0, 30.0),
    "backward": (-20.0, 10.0, 0.0, -30.0),
    "forward_just_past_margin": (11.2, 10.0, 0.0, 1.2),
    "forward_despite_round_trips": (40.0, 10.0, 2.0, 30.0),
}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_a_step_is_seen_only_beyond_the_margin_and_the_round_trips(case: str) -> None:
    db_advance, mono_advance, round_trip, want = STEPS[case]
    d = detector()
    assert d.observe(Reading(at(0), 100.0, 100.0 + round_trip)) is None  # nothing to compare
    step = d.observe(
        Reading(at(db_advance), 100.0 + mono_advance, 100.0 + mono_advance + round_trip)
    )
    if want is None:
        assert step is None
        assert d.distrust_until() is None
    else:
        assert step is not None
        assert step.seconds == pytest.approx(want)
        assert step.direction == ("forward" if want > 0 else "backward")
        assert step.at == at(db_advance)
        assert step.distrust_until == at(db_advance) + timedelta(seconds=15)
        assert d.distrust_until() == step.distrust_until


def test_readings_far_apart_may_drift_without_a_step() -> None:
    d = detector()
    d.observe(Reading(at(0), 0.0))
    hour = 3600.0
    drifted = hour + 1.0 + DRIFT * hour * 0.9  # over the margin, within the drift allowed
    assert d.observe(Reading(at(drifted), hour)) is None
    assert d.observe(Reading(at(drifted + 10 + 1.5), hour + 10)) is not None  # 10 s later: a step


def test_the_distrust_window_counts_from_the_newest_step_and_stays_after_it() -> None:
    d = detector()
    d.observe(Reading(at(0), 0.0))
    first = d.observe(Reading(at(40), 10.0))  # +30 s
    assert first is not None
    assert d.observe(Reading(at(45), 15.0)) is None  # steady again in the new base
    assert d.distrust_until() == at(55)  # the window does not move without a step
    second = d.observe(Reading(at(20), 20.0))  # stepped back by 30 s
    assert second is not None and second.direction == "backward"
    assert d.distrust_until() == at(35)  # the newest step's: it started after the first's


def test_a_reading_taken_before_the_newest_one_is_ignored() -> None:
    """Another thread's reading, asked before the newest one and answered after: nothing to
    compare it with (it would look like a step back)."""
    d = detector()
    d.observe(Reading(at(0), 0.0))
    d.observe(Reading(at(40), 10.0))  # a step forward
    assert d.observe(Reading(at(9), 9.0, 11.0)) is None  # asked before the step was seen
    assert d.observe(Reading(at(42), 12.0)) is None  # compared with the newest, not the stale


def test_one_detector_shared_by_threads_sees_a_step_once() -> None:
    d = detector()
    d.observe(Reading(at(0), 0.0))
    seen: list[object] = []
    lock = threading.Lock()

    def read(n: int) -> None:
        step = d.observe(Reading(at(40 + n * 0.01), 10.0 + n * 0.01))
        if step is not None:
            with lock:
                seen.append(step)

    threads = [threading.Thread(target=read, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 1
