"""The reconciler's own arithmetic, without a database: the defaults it is built with, how long
a lookup may take and must have left, how many operations a pass claims at once, and the
Storage it writes through."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import sessionmaker

from outbox import FakeGateway
from outbox.kinds import default_registry
from outbox.settings import Settings
from outbox.storage import storage_for
from reconciler.reconcile import Reconciler
from tests.support.old_style import OldStyle


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = create_engine("sqlite://")  # never connected to: nothing here reads or writes
    try:
        yield made
    finally:
        made.dispose()


def reconciler(engine: Engine, **kw: Any) -> Reconciler:
    return Reconciler(
        sessions=sessionmaker(engine),
        gateway=FakeGateway(),
        registry=default_registry(),
        worker="r1",
        **kw,
    )


class Resends:
    def resend(self, *args: Any, **kw: Any) -> None:
        return None


def test_built_by_hand_it_has_the_settings_defaults_and_a_pass_of_at_most_100(
    engine: Engine,
) -> None:
    """A reconciler built with only what it must be given behaves as the runtime builds it
    from default settings (``settled.runtime``): the same lease, downstream timeout and
    review threshold; a pass takes at most 100 operations."""
    r = reconciler(engine)
    fields = Settings.model_fields
    assert r.lease_seconds == fields["lease_seconds"].default == 15.0
    assert r.client_timeout == fields["downstream_timeout"].default == 10.0
    assert r.review_after == fields["review_after_seconds"].default == 600.0
    assert r.batch == 100
    assert r.actor == "reconciler:r1"


@pytest.mark.parametrize(
    ("client_timeout", "lease_seconds", "seconds", "least"),
    [
        (10.0, 15.0, 10.0, 7.5),  # half a lease is shorter than the whole lookup
        (10.0, 60.0, 10.0, 10.0),  # the whole lookup is shorter than half a lease
        (45.0, 120.0, 30.0, 30.0),  # no lookup is given more than LONGEST_LOOKUP (30 s)
    ],
)
def test_how_long_a_lookup_may_take_and_must_have_left(
    engine: Engine, client_timeout: float, lease_seconds: float, seconds: float, least: float
) -> None:
    r = reconciler(engine, client_timeout=client_timeout, lease_seconds=lease_seconds)
    assert r.lookup_seconds == seconds
    assert r.lookup_least == least


@pytest.mark.parametrize(
    ("client_timeout", "resends", "batch", "chunk"),
    [
        # leases renewed for 4 x 15 s = 60 s; each operation's lookup (and resend) twice over
        (10.0, False, 100, 3),  # 60 // (2 x 10)
        (5.0, False, 100, 6),  # 60 // (2 x 5)
        (10.0, True, 100, 1),  # 60 // (2 x (10 + 10)): a resend is given a timeout too
        (30.0, True, 100, 1),  # 60 // (2 x 60) is 0: never less than one operation
        (5.0, False, 2, 2),  # never more than the batch
    ],
)
def test_a_chunk_is_what_the_renewed_leases_leave_time_for_twice_over(
    engine: Engine, client_timeout: float, resends: bool, batch: int, chunk: int
) -> None:
    r = reconciler(
        engine,
        client_timeout=client_timeout,
        batch=batch,
        resender=Resends() if resends else None,
    )
    assert r.chunk == chunk


def test_its_storage_is_kept_while_its_engine_is_and_made_again_when_that_changes(
    engine: Engine,
) -> None:
    r = reconciler(engine)
    first = r.storage
    assert first.engine is engine
    assert r.storage is first  # kept
    other = create_engine("sqlite://")
    try:
        r.sessions = sessionmaker(other)
        assert r.storage.engine is other
        assert type(r.storage) is type(storage_for(other))
    finally:
        other.dispose()


def test_an_old_style_adapter_is_warned_about_at_the_line_that_built_the_reconciler(
    engine: Engine,
) -> None:
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        Reconciler(
            sessions=sessionmaker(engine),
            gateway=OldStyle(),
            registry=default_registry(),
            worker="r1",
        )
    (warning,) = [w for w in told if w.category is DeprecationWarning]
    assert "take the old keywords" in str(warning.message)
    assert warning.filename == __file__
