"""A kind whose order is another field than ``order_id`` (``Kind.order_field``): intake takes
that order's lock, and the console finds its operations by that order."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from outbox.intake import Outbox, order_lock
from outbox.kinds import Intent, Kind, KindRegistry, Ref
from outbox.settings import Settings
from outbox.storage.postgres import ORDER_LOCK_SPACE, ORDER_STRIPES
from support.find import Finder
from support.staff import Staff


class ParcelIntent(Intent):
    parcel: Ref
    order_id: Ref  # a field of that name that is not the kind's order


KINDS = KindRegistry([Kind("reship", ParcelIntent, "/v1/reships", order_field="parcel")])
PARAMS = {"parcel": "PCL-7", "order_id": "A1042"}
ANN = Staff.parse("ann", "support")


@pytest.fixture
def outbox(settings: Settings) -> Outbox:
    return Outbox.from_settings(settings, KINDS)


def test_the_kind_names_a_field_its_intent_has() -> None:
    with pytest.raises(ValueError, match="'parcell'"):
        Kind("reship", ParcelIntent, "/v1/reships", order_field="parcell")


def test_intake_takes_the_lock_of_the_kind_s_order_field(pg: Engine, outbox: Outbox) -> None:
    held = (
        "SELECT classid, objid, mode FROM pg_locks"
        " WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    )
    stripe = "SELECT (hashtextextended(:key, 0) & :mask)::int"
    with Session(pg) as s, s.begin():
        outbox.enqueue(s, tenant="acme", op_id="op-1", kind="reship", params=PARAMS)
        locks = s.execute(text(held)).all()
        key = order_lock("acme", "reship", "PCL-7")
        expected = s.scalar(text(stripe), {"key": key, "mask": ORDER_STRIPES - 1})
    assert [tuple(row) for row in locks] == [(ORDER_LOCK_SPACE, expected, "ShareLock")]


def test_the_console_finds_the_operation_by_the_kind_s_order(
    engine: Engine, outbox: Outbox
) -> None:
    with Session(engine) as s, s.begin():
        outbox.enqueue(s, tenant="acme", op_id="op-1", kind="reship", params=PARAMS)
    finder = Finder(sessionmaker(engine), kinds=KINDS)
    found = finder.search(ANN, "PCL-7")["results"]
    assert [(r["op_id"], r["order_id"], r["matched"]) for r in found] == [
        ("op-1", "PCL-7", ["order_id"])
    ]
    assert [r["op_id"] for r in finder.find(ANN, "order_id", "PCL-7")] == ["op-1"]
    # its order_id field is not its order
    assert finder.search(ANN, "A1042")["results"] == []
    assert finder.find(ANN, "order_id", "A1042") == []
