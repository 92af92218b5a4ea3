"""``settled ops audit`` against the real simulator, on PostgreSQL and SQLite: refunds executed
downstream whose operations a lost failover took away (a raw DELETE here) are listed, exactly
those, with one review item each, opened once however often the audit runs; an effect whose
operation is here is not listed; a downstream without the list of effects is not audited and
says so; no secret is printed.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, wire
from outbox.clock import Deadline
from outbox.downstream import EffectsListed, NotListed
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.prune import prune
from outbox.storage.audit import ORPHAN_EFFECT
from support.audit import Source, audit
from tests.integration.test_ops_cli import settled
from tests.integration.test_ops_prune import OLD, age
from tests.support.rig import GOOD, Rig
from tests.unit.test_stripe_classification import _gateway, _refund


def keys_env(rig: Rig) -> dict[str, str]:
    """The rig's tenant's key for the simulator, as the audit reads it."""
    return {
        "SETTLED_DOWNSTREAM_API_KEYS": json.dumps(
            {rig.tenant.name: rig.tenant.api_key.get_secret_value()}
        )
    }


def refunded(rig: Rig, op_id: str) -> int:
    op = rig.enqueue(op_id, params={**GOOD, "amount_minor": 100})
    rig.executor().execute([op])
    assert rig.op(op).state == "succeeded"
    return op


def lose(rig: Rig, *ops: int) -> None:
    """The operations gone whole from the database, as a failover to a lagging replica loses
    them: their rows, their attempts and events (the downstream's effects stay)."""
    with rig.sessions.begin() as s:
        for table in (OperationEvent, Attempt):
            s.execute(delete(table).where(table.operation_id.in_(ops)))
        s.execute(delete(Operation).where(Operation.id.in_(ops)))


def orphan_items(rig: Rig) -> list[ReviewItem]:
    with rig.sessions() as s:
        stmt = select(ReviewItem).where(ReviewItem.reason == ORPHAN_EFFECT)
        return list(s.scalars(stmt.order_by(ReviewItem.id)))


def test_lost_operations_effects_are_listed_with_one_review_item_each_however_often_run(
    rig: Rig,
) -> None:
    rig.judged_by_ledger = False  # the ledger holds effects the database lost: the point here
    since = datetime.now(UTC) - timedelta(minutes=1)
    lost = [refunded(rig, f"op-lost-{n}") for n in range(3)]
    kept = refunded(rig, "op-kept")
    expected = {
        rig.op(op).idempotency_key: (rig.op(op).op_id, rig.downstream_reference(op)) for op in lost
    }
    kept_key = rig.op(kept).idempotency_key
    lose(rig, *lost)

    first = settled(rig, "ops", "audit", "--since", since.isoformat(), "--json",
                    env_more=keys_env(rig))  # fmt: skip
    assert first.returncode == 1, first.stderr
    found = json.loads(first.stdout)
    assert {o["idempotency_key"]: o["reference"] for o in found["orphans"]} == {
        key: ref for key, (_, ref) in expected.items()
    }
    assert kept_key not in {o["idempotency_key"] for o in found["orphans"]}
    assert all(o["opened"] for o in found["orphans"])
    assert {(o["tenant"], o["amount_minor"], o["currency"]) for o in found["orphans"]} == {
        ("acme", 100, "CNY")
    }
    assert found["complete"] is True
    assert found["checked"] == [
        {"downstream": "http", "tenant": "acme", "effects": 4, "complete": True, "detail": None,
         "listed": True, "asked": None}
    ]  # fmt: skip
    items = orphan_items(rig)
    assert sorted(i.evidence["idempotency_key"] for i in items) == sorted(expected)
    assert {i.id for i in items} == {o["review_item"] for o in found["orphans"]}
    assert all(i.operation_id is None and i.resolved_at is None for i in items)

    again = settled(rig, "ops", "audit", "--since", since.isoformat(), env_more=keys_env(rig))
    assert again.returncode == 1, again.stderr
    assert [i.id for i in orphan_items(rig)] == [i.id for i in items]  # no second item
    table = again.stdout
    for key, (_, ref) in expected.items():
        (row,) = [line for line in table.splitlines() if ref in line]
        assert key in row and "1.00 CNY" in row and "(new)" not in row
    assert kept_key not in table
    assert "3 orphan effect(s), 0 review item(s) opened now" in table
    assert rig.tenant.api_key.get_secret_value() not in table + again.stderr + first.stdout


def test_nothing_lost_exits_zero_and_opens_nothing(rig: Rig) -> None:
    since = datetime.now(UTC) - timedelta(minutes=1)
    refunded(rig, "op-kept")
    done = settled(rig, "ops", "audit", "--since", "1h", env_more=keys_env(rig))
    assert done.returncode == 0, done.stderr
    assert "http acme: 1 effect(s) of Settled's, read to the end" in done.stdout
    assert "0 orphan effect(s)" in done.stdout
    assert orphan_items(rig) == []
    assert since < datetime.now(UTC)


def test_a_pruned_operations_effect_is_known_by_its_tombstone_not_an_orphan(rig: Rig) -> None:
    pruned = refunded(rig, "op-pruned")
    age(rig, [pruned])
    assert prune(rig.engine, OLD - timedelta(days=1)).operations == 1
    done = settled(rig, "ops", "audit", "--since", "1h", "--json", env_more=keys_env(rig))
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert found["orphans"] == [] and found["checked"][0]["effects"] == 1
    assert orphan_items(rig) == []


def test_effects_before_since_are_not_asked_for(rig: Rig) -> None:
    rig.judged_by_ledger = False
    lose(rig, refunded(rig, "op-lost"))
    later = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    done = settled(rig, "ops", "audit", "--since", later, "--json", env_more=keys_env(rig))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["orphans"] == []


def test_a_downstream_without_the_list_of_effects_is_not_audited_and_says_so(rig: Rig) -> None:
    rig.judged_by_ledger = False
    lose(rig, refunded(rig, "op-lost"))
    rig.control.set_switches(effects_list=False)
    done = settled(rig, "ops", "audit", "--since", "1h", env_more=keys_env(rig))
    assert done.returncode == 3, done.stderr
    assert "http acme: NOT AUDITED: the downstream serves no list of effects" in done.stdout
    assert "the audit is incomplete" in done.stdout
    with rig.sessions() as s:
        assert s.scalar(select(func.count()).select_from(ReviewItem)) == 0


def test_a_since_that_is_no_time_is_one_line_and_writes_nothing(rig: Rig) -> None:
    done = settled(rig, "ops", "audit", "--since", "yesterday", env_more=keys_env(rig))
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("Error: ") and "is not a time" in line


# -- what the app names from its own records: looked up one by one, on every downstream ------


def named_line(rig: Rig, op_id: str, amount: int = 100) -> str:
    return json.dumps(
        {"tenant": "acme", "op_id": op_id, "kind": "refund",
         "params": {**GOOD, "amount_minor": amount}}
    )  # fmt: skip


def audit_cli(rig: Rig, *args: str) -> Any:
    from click.testing import CliRunner

    from settled.cli import main
    from tests.integration.test_review import cli_env

    env = {**cli_env(rig), "SETTLED_DOWNSTREAM_TIMEOUT": "5"}
    return CliRunner().invoke(main, ["ops", "audit", *args], env=env, catch_exceptions=False)


@pytest.mark.parametrize("provider_rig", ["http", "wechatpay", "alipay"], indirect=True)
def test_operations_the_app_names_are_looked_up_by_their_key_where_nothing_lists_them(
    provider_rig: Rig, tmp_path: Path
) -> None:
    """WeChat Pay and Alipay, and the wire protocol without its list: a lost refund the app
    names is found by the key Settled derives from its op id (Stripe lists its refunds)."""
    rig = provider_rig
    rig.judged_by_ledger = False  # the ledger holds an effect the database lost: the point here
    rig.control.set_switches(effects_list=False)
    lost = refunded(rig, "op-named-lost")
    lost_ref = rig.downstream_reference(lost)
    kept = refunded(rig, "op-named-kept")
    lose(rig, lost)
    named = tmp_path / "named.jsonl"
    named.write_text(
        "\n".join(
            [named_line(rig, "op-named-lost"), named_line(rig, "op-named-kept"),
             named_line(rig, "op-named-never-sent"), ""]
        )
    )  # fmt: skip
    done = audit_cli(rig, "--since", "1h", "--named", str(named), "--json")
    assert done.exit_code == 1, done.output
    found = json.loads(done.output)
    (checked,) = [c for c in found["checked"] if c["asked"] is not None]
    assert [(o["op_id"], o["reference"]) for o in found["orphans"]] == [("op-named-lost", lost_ref)]
    # the kept one is known here: not asked; the one never sent is not found there
    assert (checked["tenant"], checked["asked"], checked["effects"], checked["complete"]) == (
        "acme",
        2,
        1,
        True,
    )
    items = orphan_items(rig)
    assert [(i.evidence["op_id"], i.evidence["reference"]) for i in items] == [
        ("op-named-lost", lost_ref)
    ]
    assert rig.op(kept).state == "succeeded"
    before = [i.id for i in orphan_items(rig)]
    again = audit_cli(rig, "--since", "1h", "--named", str(named))
    assert [i.id for i in orphan_items(rig)] == before  # opened once
    assert "2 named operation(s) with none here looked up, 1 made there" in again.output


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 2 is not JSON"),
        (json.dumps(["a list"]), "line 2: [named_not_object]"),
        (json.dumps({"tenant": "acme", "op_id": "x y", "kind": "refund", "params": GOOD}),
         "line 2: [invalid_op_id]"),
        (json.dumps({"tenant": "acme", "op_id": "ok", "kind": "nope", "params": GOOD}),
         "line 2: [unknown_kind]"),
        (json.dumps({"tenant": "acme", "op_id": "ok", "kind": "refund",
                     "params": {**GOOD, "amount_minor": "secret-amount"}}),
         "line 2: [invalid_params]"),
    ],
    ids=["not-json", "not-object", "bad-op-id", "unknown-kind", "bad-params"],
)  # fmt: skip
def test_a_bad_named_line_is_one_line_and_writes_nothing(
    rig: Rig, tmp_path: Path, line: str, says: str
) -> None:
    rig.judged_by_ledger = False
    lost = refunded(rig, "op-named-lost")
    lose(rig, lost)
    named = tmp_path / "named.jsonl"
    named.write_text(named_line(rig, "op-named-lost") + "\n" + line + "\n")
    done = audit_cli(rig, "--since", "1h", "--named", str(named))
    assert done.exit_code == 2, done.output
    (message,) = [m for m in done.output.splitlines() if m.startswith("Error")]
    assert says in message and "secret-amount" not in done.output
    assert orphan_items(rig) == []  # the good line before it was not looked up either


# -- Stripe: its refunds list, over the in-memory transport the Stripe tests use ---------------


class RefundPages:
    """An in-memory Stripe account's refunds list, ``per_page`` at a time (``starting_after``
    pages on), recording each list request."""

    def __init__(self, refunds: list[dict[str, Any]], per_page: int = 2) -> None:
        self.refunds, self.per_page = refunds, per_page
        self.asked: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/v1/refunds")
        self.asked.append(request)
        after = request.url.params.get("starting_after")
        ids = [r["id"] for r in self.refunds]
        start = ids.index(after) + 1 if after else 0
        page = self.refunds[start : start + self.per_page]
        more = start + self.per_page < len(self.refunds)
        return httpx.Response(200, json={"object": "list", "has_more": more, "data": page})


def _meta(op_id: str, tenant: str = "acme") -> dict[str, str]:
    return {"settled_tenant": tenant, "settled_op_id": op_id,
            "settled_idempotency_key": f"stl_{op_id}", "payee": "P-7"}  # fmt: skip


def test_stripe_refunds_naming_no_operation_here_are_orphans_once(
    engine: Engine, outbox: Outbox
) -> None:
    with Session(engine) as s, s.begin():
        outbox.enqueue(s, tenant="acme", op_id="op-here", kind="refund", params=GOOD)
    created = int(datetime.now(UTC).timestamp())
    pages = RefundPages([
        _refund(id="re_here", metadata=_meta("op-here"), created=created),
        _refund(id="re_gone", metadata=_meta("op-gone"), created=created, amount=700),
        _refund(id="re_failed", metadata=_meta("op-failed"), status="failed"),
        _refund(id="re_theirs", metadata={"order": "X1"}),  # not made by Settled
        _refund(id="re_other", metadata=_meta("op-elsewhere", tenant="t2")),
        _refund(id="re_pending", metadata=_meta("op-pending"), status="pending"),
    ])  # fmt: skip
    gateway = _gateway(pages)
    since = datetime.now(UTC) - timedelta(hours=1)
    sources = [Source("stripe", ("acme",), gateway)]
    sessions = sessionmaker(engine, expire_on_commit=False)

    def deadline() -> Deadline:
        return Deadline(datetime.now(UTC) + timedelta(seconds=5), time.monotonic() + 5)

    first = audit(sessions, sources, since, deadline=deadline)
    assert [(o.effect.reference, o.effect.op_id, o.opened) for o in first.orphans] == [
        ("re_gone", "op-gone", True), ("re_pending", "op-pending", True)
    ]  # fmt: skip
    gone = first.orphans[0].effect
    assert (gone.tenant, gone.amount_minor, gone.currency, gone.idempotency_key) == (
        "acme", 700, "EUR", "stl_op-gone"
    )  # fmt: skip
    assert gone.created == datetime.fromtimestamp(created, UTC)
    assert first.complete and first.checked[0].effects == 3  # here, gone, pending: acme's
    assert [r.url.params.get("created[gte]") for r in pages.asked] == [
        str(int(since.timestamp()))
    ] * 3
    assert [r.url.params.get("starting_after") for r in pages.asked] == [
        None, "re_gone", "re_theirs"
    ]  # fmt: skip

    again = audit(sessions, sources, since, deadline=deadline)
    assert [(o.item, o.opened) for o in again.orphans] == [(o.item, False) for o in first.orphans]
    with Session(engine) as s:
        items = list(s.scalars(select(ReviewItem).order_by(ReviewItem.id)))
    assert [(i.effect, i.reason, i.evidence["reference"]) for i in items] == [
        ("stripe:acme:re_gone", "orphan_effect", "re_gone"),
        ("stripe:acme:re_pending", "orphan_effect", "re_pending"),
    ]


def test_stripe_list_failing_midway_keeps_what_it_read_and_says_incomplete(
    engine: Engine,
) -> None:
    served = RefundPages([_refund(id="re_a", metadata=_meta("op-a")),
                          _refund(id="re_b", metadata=_meta("op-b"))], per_page=1)  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("starting_after"):
            return httpx.Response(500, json={"error": {"type": "api_error", "message": "x"}})
        return served(request)

    gateway = _gateway(handler)
    listed = gateway.effects_since(
        "acme", datetime.now(UTC) - timedelta(hours=1),
        deadline=datetime.now(UTC) + timedelta(seconds=5),
    )  # fmt: skip
    assert isinstance(listed, EffectsListed)
    assert [e.reference for e in listed.effects] == ["re_a"]
    assert listed.complete is False and "APIError" in (listed.detail or "")
    assert isinstance(
        gateway.effects_since("nobody", datetime.now(UTC), deadline=datetime.now(UTC)), NotListed
    )


def test_orphan_items_are_in_the_review_queue_and_their_page_says_why_nothing_settles(
    rig: Rig,
) -> None:
    rig.judged_by_ledger = False
    op = refunded(rig, "op-lost")
    key = rig.op(op).idempotency_key
    lose(rig, op)
    assert settled(rig, "ops", "audit", "--since", "1h", env_more=keys_env(rig)).returncode == 1
    staff = ("--staff", "s1", "--role", "support")

    listed = settled(rig, "review", "list", *staff, "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["reason"], row["kind"], row["state"], row["amount_minor"], row["currency"]) == (
        "orphan_effect", None, None, 100, "CNY"
    )  # fmt: skip
    assert row["evidence"]["idempotency_key"] == key
    table = settled(rig, "review", "list", *staff).stdout
    assert "orphan_effect" in table.splitlines()[1] and "None" not in table

    shown = settled(rig, "review", "show", str(row["id"]), *staff)
    assert shown.returncode == 1
    (line,) = shown.stderr.splitlines()
    assert line.startswith("Error: [orphan_effect_item] this item is an orphan effect")


def test_an_orphan_item_is_resolved_only_as_succeeded_with_its_reference_and_a_statement(
    rig: Rig,
) -> None:
    rig.judged_by_ledger = False
    lose(rig, refunded(rig, "op-lost"))
    found = json.loads(
        settled(rig, "ops", "audit", "--since", "1h", "--json", env_more=keys_env(rig)).stdout
    )
    (orphan,) = found["orphans"]
    item, ref = str(orphan["review_item"]), orphan["reference"]
    staff = ("--staff", "s1", "--role", "support")
    why = "booked in the ledger by hand; the app re-created the order record (ticket 88)"

    refused = [
        settled(rig, "review", "resolve", item, "--as", "rejected", "--version", "1",
                "--justification", why, *staff),  # the downstream did it: never "rejected"
        settled(rig, "review", "resolve", item, "--as", "succeeded", "--version", "1",
                "--reference", ref, *staff),  # no statement of what was done
        settled(rig, "review", "resolve", item, "--as", "succeeded", "--version", "1",
                "--reference", "re_other", "--justification", why, *staff),
        settled(rig, "review", "resolve", item, "--as", "succeeded", "--version", "1",
                "--reference", ref, "--justification", why, "--staff", "v", "--role", "viewer"),
    ]  # fmt: skip
    assert [r.returncode for r in refused] == [1, 1, 1, 1]
    assert "[orphan_resolution]" in refused[0].stderr + refused[1].stderr
    assert "[reference_mismatch]" in refused[2].stderr
    (open_item,) = orphan_items(rig)
    assert open_item.resolved_at is None

    done = settled(rig, "review", "resolve", item, "--as", "succeeded", "--version", "1",
                   "--reference", ref, "--justification", why, *staff)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (closed,) = orphan_items(rig)
    assert (closed.resolved_by, closed.resolution["reference"]) == ("staff:s1", ref)
    again = settled(rig, "ops", "audit", "--since", "1h", "--json", env_more=keys_env(rig))
    (still,) = json.loads(again.stdout)["orphans"]
    assert (still["review_item"], still["opened"]) == (closed.id, False)  # never reopened
    assert len(orphan_items(rig)) == 1


def test_the_simulators_list_of_effects_pages_and_leaves_refusals_out(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.judged_by_ledger = False
    made = [refunded(rig, f"op-{n}") for n in range(3)]
    rig.control.add_rule("business_reject", times=1)
    refused = rig.enqueue("op-refused", params={**GOOD, "amount_minor": 100})
    rig.executor().execute([refused])
    assert (rig.op(refused).state, rig.op(refused).reason) == ("rejected", "business_rejected")
    auth = {"Authorization": f"Bearer {rig.tenant.api_key.get_secret_value()}"}
    url = rig.url + "/v1/effects"

    seen, after = [], None
    with httpx.Client(headers=auth, timeout=5) as client:
        while True:
            page = client.get(
                url, params={"limit": 1, **({"starting_after": after} if after else {})}
            )
            assert page.status_code == 200
            body = page.json()
            seen.extend(e["idempotency_key"] for e in body["data"])
            if not body["has_more"]:
                break
            after = body["data"][-1]["id"]
        assert seen == [rig.op(op).idempotency_key for op in made]  # oldest first, no refusal
        assert client.get(url, params={"since": "x"}).status_code == 400
        assert client.get(url, params={"limit": 101}).status_code == 400
        assert client.get(url, params={"starting_after": "re_nope"}).status_code == 400
        assert client.get(url, params={"since": time.time() + 60}).json()["data"] == []

    monkeypatch.setattr(wire, "EFFECTS_PAGE_MAX", 1)  # the gateway reads a page at a time
    gateway = rig.gateway()
    listed = gateway.effects_since(
        "acme", datetime.now(UTC) - timedelta(hours=1),
        deadline=datetime.now(UTC) + timedelta(seconds=5),
    )  # fmt: skip
    assert isinstance(listed, EffectsListed) and listed.complete
    assert [e.idempotency_key for e in listed.effects] == seen  # three pages of one, in order
