"""``support.find.Finder.search`` on both backends: the console also runs on the embedded
SQLite default, where JSON paths and LIKE are SQLite's own."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from outbox.intake import Outbox
from support.find import Finder
from support.staff import Staff
from tests.support.rig import GOOD

ANY = Staff.parse("vera", "viewer")
ACME_ONLY = Staff("ann", ANY.role, frozenset({"acme"}))


def test_search_finds_by_each_key_and_prefix_on_both_backends(
    engine: Engine, outbox: Outbox
) -> None:
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        for tenant, op_id, params in [
            ("acme", "op-1", {**GOOD, "order_id": "A1_42", "payee": "P-1"}),
            ("acme", "op-2", {**GOOD, "order_id": "A1042", "amount_minor": 5000}),
            ("globex", "op-3", {**GOOD, "order_id": "A1043"}),
        ]:
            outbox.enqueue(s, tenant=tenant, op_id=op_id, kind="refund", params=params)

    def found(staff: Staff, q: str) -> list[tuple[Any, ...]]:
        got = Finder(sessions).search(staff, q)["results"]
        return [(r["op_id"], r["group"], r["amount"], r["matched"]) for r in got]

    assert found(ANY, "A1042") == [("op-2", "not_done", "50.00 CNY", ["order_id"])]
    assert {r[0] for r in found(ANY, "A104")} == {"op-2", "op-3"}
    assert found(ANY, "A1_4") == [("op-1", "not_done", "100.00 CNY", ["order_id_prefix"])]
    assert found(ANY, "A10%") == []
    assert found(ANY, "P-1") == [("op-1", "not_done", "100.00 CNY", ["payee"])]
    assert [r[0] for r in found(ANY, "op-")] == ["op-3", "op-2", "op-1"]  # newest first
    assert [r[0] for r in found(ACME_ONLY, "op-")] == ["op-2", "op-1"]
    assert found(ACME_ONLY, "A1043") == []
