"""The database's time as a process measures it (``outbox.clock``): a reading plus the monotonic
time since, and deadlines that carry one moment on both clocks. Every time the fence compares
(the send bound, the lookup's date, the lease's end) is built from these. Written to kill
mutants the mutation suite let through (docs/mutation.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from outbox.clock import DbClock, Deadline, Reading, Step, StepDetector

DB_AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def test_now_is_the_reading_plus_the_monotonic_time_since() -> None:
    ticks = Ticks(100.0)
    clock = DbClock(DB_AT, 100.0, monotonic=ticks)
    assert clock.now() == DB_AT
    ticks.at = 103.5
    assert clock.now() == DB_AT + timedelta(seconds=3.5)


def test_a_deadline_is_the_same_moment_on_both_clocks() -> None:
    ticks = Ticks(100.0)
    clock = DbClock(DB_AT, 90.0, monotonic=ticks)  # read 10 s ago
    deadline = clock.deadline(DB_AT + timedelta(seconds=30))
    assert (deadline.at, deadline.expires) == (DB_AT + timedelta(seconds=30), 120.0)
    assert deadline.left() == 20.0
    assert clock.after(5).expires == 95.0
    ticks.at = 130.0
    assert deadline.left() == 0.0  # passed: never negative


def test_capped_moves_both_clocks_by_the_same_amount() -> None:
    ticks = Ticks(100.0)
    far = Deadline(DB_AT + timedelta(seconds=60), 160.0, ticks)
    capped = far.capped(10)
    assert (capped.at, capped.expires) == (DB_AT + timedelta(seconds=10), 110.0)
    assert far.capped(60) is far and far.capped(90) is far  # already sooner (or at it)


def test_earlier_is_the_one_that_expires_first() -> None:
    ticks = Ticks(0.0)
    a = Deadline(DB_AT, 10.0, ticks)
    b = Deadline(DB_AT + timedelta(seconds=5), 15.0, ticks)
    assert a.earlier(b) is a and b.earlier(a) is a
    same = Deadline(DB_AT, 10.0, ticks)
    assert a.earlier(same) is a  # a tie keeps this one


def test_a_wall_clock_deadline_expires_as_far_ahead_as_it_is() -> None:
    deadline = Deadline.from_wall(DB_AT + timedelta(seconds=7), DB_AT, monotonic=Ticks(50.0))
    assert deadline.expires == 57.0


def test_capped_by_less_than_a_second_still_moves_it() -> None:
    far = Deadline(DB_AT + timedelta(seconds=60), 160.0, Ticks(100.0))
    capped = far.capped(59.5)
    assert (capped.at, capped.expires) == (DB_AT + timedelta(seconds=59.5), 159.5)


def test_a_step_is_forward_or_backward_by_its_sign_however_small() -> None:
    assert Step(0.5, DB_AT, DB_AT).direction == "forward"
    assert Step(-0.5, DB_AT, DB_AT).direction == "backward"


def test_a_reading_taken_at_the_same_monotonic_instant_is_still_compared() -> None:
    detector = StepDetector(margin=1.0, window=30.0)
    assert detector.observe(Reading(DB_AT, 100.0)) is None
    step = detector.observe(Reading(DB_AT + timedelta(seconds=10), 100.0))
    assert step is not None and step.seconds == 10.0
    assert detector.distrust_until() == DB_AT + timedelta(seconds=40)


def test_a_move_of_exactly_the_margin_is_not_a_step_either_way() -> None:
    for moved in (1.0, -1.0):
        detector = StepDetector(margin=1.0, window=30.0)
        assert detector.observe(Reading(DB_AT, 100.0)) is None
        assert detector.observe(Reading(DB_AT + timedelta(seconds=moved), 100.0)) is None
        assert detector.distrust_until() is None
