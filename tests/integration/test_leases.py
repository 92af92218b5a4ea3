"""Short leases renewed while their holder works (``outbox.leases``), against PostgreSQL and
SQLite: what is renewed, what never is, and a live worker that outlasts its first lease is not
overtaken."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update

from outbox.db import db_now
from outbox.downstream import SubmitOutcome
from outbox.leases import LeaseKeeper
from outbox.models import Operation
from outbox.states import State
from outbox.storage import operations
from outbox.storage.claims import Claimed, due_ids
from tests.support.gateways import FakeMonotonic, Interposed
from tests.support.rig import Rig
from tests.support.services import wait_until


def claim(rig: Rig, op: int, worker: str = "w1", lease: float = 30.0) -> Claimed:
    return rig.claim(op, worker=worker, lease=lease)


def lease_of(rig: Rig, op: int) -> tuple[datetime | None, int, str | None]:
    row = rig.op(op)
    return row.lease_until, row.lease_version, row.lease_owner


def db_time(rig: Rig) -> datetime:
    with rig.sessions() as s:
        return operations.db_time(s)


def keeper(rig: Rig, owner: str = "w1", **kw: object) -> LeaseKeeper:
    return LeaseKeeper(rig.sessions, owner=owner, lease_seconds=kw.pop("lease", 30.0), **kw)  # type: ignore[arg-type]


def test_a_held_lease_is_renewed_in_database_time_under_the_same_version(rig: Rig) -> None:
    rig.judged_by_ledger = False  # nothing is sent here
    op = rig.enqueue()
    claimed = claim(rig, op, lease=5.0)
    k = keeper(rig, lease=600.0)
    with k.holding([claimed]):
        assert k.renew_now() == {op}
    until, version, owner = lease_of(rig, op)
    assert until is not None and (until - db_time(rig)).total_seconds() > 500
    assert (version, owner) == (claimed.lease_version, "w1")
    # Released: nothing more is renewed.
    assert k.held() == set()
    assert k.renew_now() == set()


def test_the_holder_is_told_how_long_its_lease_is_held_now(rig: Rig) -> None:
    """``lease_until``: the claim's end, then each renewal's (what the database wrote), and
    None once the database refused to renew it; back to the claim's once released."""
    rig.judged_by_ledger = False
    op = rig.enqueue()
    claimed = claim(rig, op, lease=5.0)
    k = keeper(rig, lease=600.0)
    with k.holding([claimed]):
        assert k.lease_until(claimed) == claimed.lease_until
        assert k.renew_now() == {op}
        renewed = k.lease_until(claimed)
        assert renewed is not None and renewed == lease_of(rig, op)[0]
        assert (renewed - claimed.lease_until).total_seconds() > 500
        with rig.sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id == op).values(lease_until=db_now(-1)))
        assert k.renew_now() == set()
        assert k.lease_until(claimed) is None  # lapsed: it may be another's already
    assert k.lease_until(claimed) == claimed.lease_until  # nothing kept of a released claim


def test_a_lapsed_lease_is_never_revived(rig: Rig) -> None:
    rig.judged_by_ledger = False
    op = rig.enqueue()
    claimed = claim(rig, op)
    with rig.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == op).values(lease_until=db_now(-1)))
    k = keeper(rig)
    with k.holding([claimed]):
        assert k.renew_now() == set()
        assert k.held() == set()  # dropped: the holder learns it at its fenced write
    until, _, _ = lease_of(rig, op)
    assert until is not None and until < db_time(rig)


def test_a_lease_taken_over_is_not_renewed_for_its_old_holder(rig: Rig) -> None:
    rig.judged_by_ledger = False
    op = rig.enqueue()
    old = claim(rig, op)
    with rig.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == op).values(lease_until=db_now(-1)))
    new = claim(rig, op, worker="w2", lease=2.0)
    assert new.lease_version == old.lease_version + 1
    k = keeper(rig)
    with k.holding([old]):
        assert k.renew_now() == set()
    assert lease_of(rig, op) == (new.lease_until, new.lease_version, "w2")
    # Even under the old holder's name, a stale version renews nothing.
    with rig.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == op).values(lease_owner="w1"))
    with k.holding([old]):
        assert k.renew_now() == set()


def test_renewal_ends_after_the_longest_hold(rig: Rig) -> None:
    rig.judged_by_ledger = False
    op = rig.enqueue()
    claimed = claim(rig, op, lease=5.0)
    mono = FakeMonotonic()
    k = keeper(rig, lease=5.0, monotonic=mono)
    assert k.longest == 20.0
    with k.holding([claimed]):
        mono.advance(19.0)
        assert k.renew_now() == {op}
        mono.advance(1.0)  # a thread stuck this long holds nothing any more
        assert k.renew_now() == set()
        assert k.held() == set()


def test_the_keeper_renews_on_its_own_while_the_work_goes_on(rig: Rig) -> None:
    rig.judged_by_ledger = False
    op = rig.enqueue()
    claimed = claim(rig, op, lease=0.9)
    k = keeper(rig, lease=0.9)
    try:
        with k.holding([claimed]):
            renewed = wait_until(lambda: (lease_of(rig, op)[0] or claimed.lease_until)
                                 > claimed.lease_until, timeout=15)  # fmt: skip
            assert renewed, "the keeper's thread never renewed the lease"
            assert lease_of(rig, op)[1] == claimed.lease_version
    finally:
        k.close()


def test_a_live_worker_past_its_first_lease_is_not_overtaken(rig: Rig) -> None:
    """The outcome write comes after the claimed lease would have lapsed (a slow database):
    the lease was renewed meanwhile, so no other worker or sweep took the operation, and the
    outcome is written under the claim's own version."""
    op = rig.enqueue()
    executor = rig.executor(lease_seconds=2.0, clock_margin=0.1)
    seen: dict[str, object] = {}

    def after_the_send(outcome: SubmitOutcome) -> SubmitOutcome:
        first = rig.op(op)
        assert first.lease_until is not None
        original = first.lease_until
        # The database's clock passes the lease this claim was taken with.
        assert wait_until(lambda: db_time(rig) > original, timeout=15)
        with rig.sessions() as s:
            seen["due"] = op in due_ids(s, limit=100)
        seen["other"] = rig.executor(worker="w2").execute([op])
        seen["lease"] = lease_of(rig, op)
        seen["original"] = original
        return outcome

    executor.gateway = Interposed(executor.gateway, rewrite_submit=after_the_send)
    try:
        assert executor.execute([op]) == {op: State.SUCCEEDED}
    finally:
        executor.close()
    assert seen["due"] is False
    assert seen["other"] == {}
    until, version, owner = seen["lease"]  # type: ignore[misc]
    assert until > seen["original"] and owner == "w1"  # type: ignore[operator]
    row = rig.op(op)
    assert (row.state, row.lookups, row.lease_owner) == ("succeeded", 0, None)
    assert row.lease_version == version
    assert rig.sends(op) == 1 and rig.effects(op) == 1
    with rig.sessions() as s:
        assert s.scalar(select(Operation.attempts).where(Operation.id == op)) == 1
