"""The hint breaker (``outbox.breaker``): after a hint the broker did not take, the app skips
hints for a cool-down without touching the broker, then one caller tries again; each hint is
counted, and an outage is logged twice (a WARNING, then an INFO with what it cost), with no
exception text."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence

import pytest

from outbox.breaker import HintBreaker
from outbox.logs import JsonFormatter
from outbox.relay import publish_hints

#: what an exception text of a broker library may carry, and a log line never may
SECRET_URL = "redis://:s3cret-password@redis.internal:6390/0"


class Broker:
    """A publish that takes its hints, or fails them while ``down``, as a broker would."""

    def __init__(self) -> None:
        self.down = False
        self.tries = 0
        self.taken: list[list[int]] = []

    def __call__(self, operation_ids: Sequence[int]) -> None:
        self.tries += 1
        if self.down:
            raise ConnectionError(f"Error 111 connecting to {SECRET_URL}. Connection refused.")
        self.taken.append(list(operation_ids))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def broker() -> Broker:
    return Broker()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def counted() -> Counter[str]:
    return Counter()


@pytest.fixture
def breaker(broker: Broker, clock: Clock, counted: Counter[str]) -> HintBreaker:
    return HintBreaker(
        broker, cooldown=5.0, count=lambda outcome: counted.update([outcome]), broker="redis://:***@redis.internal:6390/0",
        monotonic=clock,
    )  # fmt: skip


def hint(breaker: HintBreaker, *ids: int) -> int:
    """What the relay does with one commit's ids: how many went out."""
    return publish_hints(breaker, list(ids))


def breaker_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in ("outbox.breaker", "outbox.relay")]


def test_after_a_failure_hints_are_skipped_without_touching_the_broker(
    breaker: HintBreaker, broker: Broker, clock: Clock, counted: Counter[str]
) -> None:
    assert hint(breaker, 1) == 1
    broker.down = True
    assert hint(breaker, 2) == 0  # tried: the broker refused it
    tries = broker.tries
    for op in range(3, 13):
        clock.now += 0.4  # ten hints inside the cool-down of 5 s
        assert hint(breaker, op) == 0
    assert broker.tries == tries  # none of them reached the broker
    assert counted == {"published": 1, "failed": 1, "skipped": 10}
    assert breaker.open


def test_one_hint_is_tried_per_cool_down_and_a_success_closes_the_breaker(
    breaker: HintBreaker, broker: Broker, clock: Clock, counted: Counter[str]
) -> None:
    broker.down = True
    hint(breaker, 1)
    clock.now += 5.0
    hint(breaker, 2)  # the cool-down is over: tried, and failed again
    hint(breaker, 3)  # a new cool-down from that failure
    assert broker.tries == 2
    broker.down = False
    hint(breaker, 4)  # still inside it: skipped, though the broker is back
    clock.now += 5.0
    assert hint(breaker, 5) == 1
    assert hint(breaker, 6) == 1  # closed: every hint goes out again
    assert broker.taken == [[5], [6]]
    assert counted == {"failed": 2, "skipped": 2, "published": 2}
    assert not breaker.open


def test_while_one_caller_tries_the_others_skip(
    broker: Broker, clock: Clock, counted: Counter[str]
) -> None:
    """Past the cool-down only one caller meets the broker: a slow broker is not met by every
    request of the app at once."""
    trying, release = threading.Event(), threading.Event()

    def slow(operation_ids: Sequence[int]) -> None:
        if not broker.down:
            trying.set()
            assert release.wait(10)
        broker(operation_ids)

    breaker = HintBreaker(
        slow, cooldown=5.0, count=lambda outcome: counted.update([outcome]), monotonic=clock
    )
    broker.down = True
    hint(breaker, 1)
    broker.down = False
    clock.now += 5.0  # the cool-down is over: the next caller tries
    first = threading.Thread(target=publish_hints, args=(breaker, [2]))
    first.start()
    assert trying.wait(10)
    assert hint(breaker, 3) == 0  # the first caller is still trying: this one skips
    release.set()
    first.join(10)
    assert counted == {"failed": 1, "skipped": 1, "published": 1}
    assert broker.taken == [[2]]
    assert not breaker.open


def test_a_hint_begun_before_the_first_failure_does_not_end_the_outage(
    broker: Broker, clock: Clock, counted: Counter[str]
) -> None:
    sent: list[Sequence[int]] = []

    def publish(operation_ids: Sequence[int]) -> None:
        if operation_ids == [2]:
            raise ConnectionError("refused")
        if operation_ids == [1]:  # a slow first caller: another's hint fails meanwhile
            clock.now += 1.0
            assert hint(late, 2) == 0
        sent.append(operation_ids)

    late = HintBreaker(
        publish, cooldown=5.0, count=lambda outcome: counted.update([outcome]), monotonic=clock
    )
    assert hint(late, 1) == 1
    assert late.open  # that success began before the failure: it proves nothing of now
    assert hint(late, 3) == 0
    assert counted == {"failed": 1, "published": 1, "skipped": 1}


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    breaker: HintBreaker, broker: Broker, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    hint(breaker, 1)
    broker.down = True
    for op in range(2, 30):  # three tries in all, 25 hints skipped
        clock.now += 0.5
        hint(breaker, op)
    assert broker.tries == 1 + 3
    broker.down = False
    clock.now += 5.0
    hint(breaker, 30)
    hint(breaker, 31)
    lines = breaker_lines(caplog)
    assert [(r.levelname, r.name) for r in lines] == [
        ("WARNING", "outbox.breaker"),
        ("INFO", "outbox.breaker"),
    ]
    began, ended = (json.loads(JsonFormatter().format(r)) for r in lines)
    assert (began["error"], began["cooldown_seconds"]) == ("ConnectionError", 5.0)
    assert (ended["skipped"], ended["failed"]) == (25, 3)
    assert ended["duration_ms"] == 18_500  # from the first failure to the first success
    for record, line in zip(lines, (began, ended), strict=True):
        assert record.exc_info is None
        assert "s3cret" not in json.dumps(line) and "s3cret" not in record.getMessage()
        assert line["broker"] == "redis://:***@redis.internal:6390/0"


def test_a_second_outage_is_logged_and_counted_afresh(
    breaker: HintBreaker, broker: Broker, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(2):
        broker.down = True
        hint(breaker, 1)
        hint(breaker, 2)
        broker.down = False
        clock.now += 5.0
        hint(breaker, 3)
    lines = breaker_lines(caplog)
    assert [r.levelname for r in lines] == ["WARNING", "INFO", "WARNING", "INFO"]
    assert [(getattr(r, "skipped", None), getattr(r, "failed", None)) for r in lines[1::2]] == [
        (1, 1),
        (1, 1),
    ]


def test_a_cool_down_must_be_positive(broker: Broker) -> None:
    with pytest.raises(ValueError, match="cooldown"):
        HintBreaker(broker, cooldown=0)
