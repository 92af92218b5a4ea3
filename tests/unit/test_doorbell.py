"""The doorbell's count (``outbox.doorbell``) on fakeredis: places taken and given back, rings
that age out, and the relay's publish failing open."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import fakeredis
import pytest
import redis

from outbox.doorbell import Doorbell, ring_again, rung
from outbox.settings import Settings
from settled.celery_app import UNREACHABLE, create_app, doorbell


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def client(server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=server)


def bell(client: fakeredis.FakeRedis, pending: int = 2, claims: int = 8) -> Doorbell:
    return Doorbell(client, pending=pending, ring_seconds=60, claims=claims, key="bell")


class Published:
    def __init__(self, fail: bool = False) -> None:
        self.messages: list[list[int]] = []
        self.fail = fail

    def __call__(self, ids: Sequence[int]) -> None:
        if self.fail:
            raise redis.ConnectionError("broker down")
        self.messages.append(list(ids))


def test_rings_are_taken_up_to_the_limit_and_answering_frees_one(
    client: fakeredis.FakeRedis,
) -> None:
    b = bell(client)
    first, second = b.ring(), b.ring()
    assert first and second and first != second
    assert b.ring() == 0  # both places taken
    b.answer()
    third = b.ring()
    assert third and third not in (first, second)
    assert b.ring() == 0
    assert client.zcard("bell") == 2


def test_a_ring_nobody_answered_ages_out(client: fakeredis.FakeRedis) -> None:
    b = bell(client, pending=1)
    ring = b.ring()
    assert b.ring() == 0
    client.zadd("bell", {str(ring): 0})  # rung long ago: its hint was lost
    assert b.ring() != 0


def test_answering_an_empty_bell_or_a_redis_error_is_harmless(
    client: fakeredis.FakeRedis, server: fakeredis.FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    b = bell(client, pending=1)
    b.answer()  # a redelivered doorbell hint: nothing to take
    assert b.ring() != 0
    server.connected = False
    b.answer()
    assert "expires on its own" in caplog.text


def test_the_relay_publishes_a_doorbell_hint_only_while_a_place_is_free(
    client: fakeredis.FakeRedis,
) -> None:
    sent = Published()
    publish = rung(sent, bell(client))
    for op in range(1, 6):
        publish([op])
    assert sent.messages == [[], []]  # two doorbell hints, no ids: they claim what is due


def test_a_hint_of_as_many_ids_as_a_claim_takes_is_published_as_it_is(
    client: fakeredis.FakeRedis,
) -> None:
    sent = Published()
    publish = rung(sent, bell(client, pending=1, claims=3))
    publish([1, 2, 3])  # a transaction of three: its own hint claims them all
    publish([4, 5])
    publish([6])
    publish([7, 8, 9, 10])
    assert sent.messages == [[1, 2, 3], [], [7, 8, 9, 10]]
    assert client.zcard("bell") == 1  # only the doorbell hint counts


def test_an_unreachable_bell_publishes_the_hint_as_without_a_doorbell(
    client: fakeredis.FakeRedis, server: fakeredis.FakeServer
) -> None:
    sent = Published()
    publish = rung(sent, bell(client))
    server.connected = False
    publish([7, 8])
    assert sent.messages == [[7, 8]]


def raising(exc: Exception) -> Callable[[], int]:
    def ring() -> int:
        raise exc

    return ring


def test_a_bell_whose_broker_is_unreachable_fails_the_hint_without_publishing(
    client: fakeredis.FakeRedis, server: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's doorbell is on the broker's Redis: a refused connection or a timeout there is
    the broker's, and publishing would only wait on it again (the breaker counts the hint)."""
    sent = Published()
    b = bell(client)
    publish = rung(sent, b, unreachable=UNREACHABLE)
    server.connected = False
    with pytest.raises(redis.ConnectionError):
        publish([7, 8])
    monkeypatch.setattr(b, "ring", raising(redis.TimeoutError("no answer in time")))
    with pytest.raises(redis.TimeoutError):
        publish([9])
    assert sent.messages == []
    # Any other Redis error still fails open: the hint goes out as without a doorbell.
    monkeypatch.setattr(b, "ring", raising(redis.ResponseError("NOSCRIPT")))
    publish([10])
    assert sent.messages == [[10]]


def test_a_hint_not_published_gives_its_place_back(client: fakeredis.FakeRedis) -> None:
    b = bell(client, pending=1)
    with pytest.raises(redis.ConnectionError):
        rung(Published(fail=True), b)([1])  # the relay logs it; the sweeper covers it
    assert client.zcard("bell") == 0
    sent = Published()
    rung(sent, b)([2])
    assert sent.messages == [[]]


def test_ringing_again_never_raises(client: fakeredis.FakeRedis) -> None:
    b = bell(client, pending=1)
    again = ring_again(Published(fail=True), b)
    again()  # logged: the sweeper brings what is due
    sent = Published()
    ring_again(sent, b)()
    ring_again(sent, b)()
    assert sent.messages == [[]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pending": 0, "ring_seconds": 1, "claims": 1}, "pending"),
        ({"pending": 1, "ring_seconds": 0, "claims": 1}, "ring_seconds"),
        ({"pending": 1, "ring_seconds": 1, "claims": 0}, "claims"),
    ],
)
def test_a_bell_needs_a_place_and_a_lifetime(
    client: fakeredis.FakeRedis, kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Doorbell(client, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "on"),
    [
        ({"hint_doorbell": 4, "claim_batch": 2}, True),
        ({"hint_doorbell": 4, "claim_batch": 0}, False),  # a doorbell hint would claim nothing
        ({"hint_doorbell": 0, "claim_batch": 8}, False),
        ({"hint_doorbell": 4, "broker_url": "filesystem://"}, False),
    ],
)
def test_the_app_rings_only_when_a_doorbell_hint_can_claim(
    settings: dict[str, object], on: bool
) -> None:
    bell = doorbell(Settings.model_validate(settings))
    assert (bell is not None) == on
    if bell is not None:
        assert (bell.pending, bell.claims) == (4, 2)


def test_a_worker_answers_doorbell_hints_whatever_its_own_settings(tmp_path: Path) -> None:
    app = create_app(Settings(hint_doorbell=0, claim_batch=0))
    assert app.doorbell is None  # this process does not ring
    assert app.bell is not None and (app.bell.pending, app.bell.claims) == (4, 8)
    assert (
        create_app(Settings(broker_url="filesystem://", broker_folder=str(tmp_path))).bell is None
    )
