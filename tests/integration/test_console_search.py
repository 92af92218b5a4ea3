"""The console's one search box (``support.find.Finder.search``, ``GET /console/find?q=``) over
a real PostgreSQL database and the simulator: every key it finds by, the start of an order id
or op id, LIKE wildcards standing for themselves, tenant limits answering like nothing found,
bad text refused with nothing written, and two partial refunds on one order told apart by
amount and by the run report's words. The console fixture is ``test_console_pages``'s."""

# ruff: noqa: F811
# (the fixtures imported from test_console_pages are the arguments of the tests)

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox import runs
from outbox.errors import InvalidInput
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem, Run
from support.find import Finder
from tests.integration.test_console_pages import (  # noqa: F401 (fixtures)
    ANN,
    GLOBEX_ONLY,
    VERA,
    Console,
    console,
    engine,
)
from tests.support.rig import GOOD, Rig


def made(
    rig: Rig, op_id: str, *, tenant: str = "acme", run: Run | None = None, **params: Any
) -> Operation:
    """An operation written by hand (nothing sent)."""
    rig.judged_by_ledger = False
    with rig.sessions.begin() as s:
        return rig.outbox.enqueue(
            s, tenant=tenant, op_id=op_id, kind="refund", params={**GOOD, **params}, run=run
        ).operation


def rows(page: str) -> list[dict[str, str]]:
    """The result rows of a search page: op id, group, and each cell's text."""
    found = []
    body = page.split('id="results"')[1].split("</table>")[0] if 'id="results"' in page else ""
    for op, group, cells in re.findall(
        r'<tr data-op="([^"]+)" data-group="(\w+)">(.*?)</tr>', body, re.S
    ):
        text = [
            re.sub(r"<[^>]+>", "", c).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)
        ]
        named = ("status", "amount", "payee", "order", "operation", "age", "matched")
        found.append({"op": op, "group": group, **dict(zip(named, text, strict=True))})
    return found


def searched(console: Console, q: str) -> list[dict[str, str]]:
    r = console.get("/console/find", q=q)
    assert r.status_code == 200, r.text[:300]
    return rows(r.text)


def written(rig: Rig) -> tuple[int, ...]:
    with rig.sessions() as s:
        return tuple(
            s.scalar(select(func.count()).select_from(t)) or 0
            for t in (Operation, OperationEvent, Attempt, ReviewItem, Run)
        )


def test_two_partial_refunds_on_one_order_are_told_apart(console: Console) -> None:
    """The question "was the refund for order A1042 paid?" in one search: both refunds, each
    with its amount and its answer in the report's words."""
    rig = console.rig
    paid = rig.enqueue("op-paid", {**GOOD, "amount_minor": 10000})
    rig.executor().execute([paid])
    rig.control.add_rule("commit_then_reset", times=1)
    unsure = rig.enqueue("op-unsure", {**GOOD, "amount_minor": 5000})
    rig.executor().execute([unsure])
    assert (rig.op(paid).state, rig.op(unsure).state) == ("succeeded", "unknown")

    page = console.as_(VERA).get("/console/find", q=" A1042 ").text
    found = rows(page)
    assert [(f["op"], f["group"], f["amount"]) for f in found] == [
        ("op-unsure", "uncertain", "50.00 CNY"),  # newest first
        ("op-paid", "done", "100.00 CNY"),
    ]
    # and when it is decided at the latest (``outbox.verdict_due``)
    assert re.fullmatch(
        r"Uncertain decided by \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC at the latest", found[0]["status"]
    ), found[0]["status"]
    assert found[1]["status"] == f"Done receipt {rig.op(paid).downstream_ref}"
    assert all(f["payee"] == "P-7" and f["order"] == "A1042" for f in found)
    assert all(f["matched"] == "order id" for f in found)
    assert all(re.fullmatch(r"just now|\d+ s ago", f["age"]) for f in found)
    assert 'href="/console/operations/acme/op-paid"' in page
    created = rig.op(paid).created_at.strftime("%Y-%m-%dT%H:%M:%SZ")  # no microseconds
    shown = rig.op(paid).created_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert f'<time datetime="{created}" title="{shown}">' in page
    assert 'value="A1042"' in page  # the header's box keeps what was searched
    zh = rows(console.get("/console/find", q="A1042", lang="zh").text)
    assert [f["status"].split()[0] for f in zh] == ["待确认", "已完成"]
    assert all(f["age"] == "刚刚" or f["age"].endswith("前") for f in zh)


def test_each_key_finds_the_operation(console: Console) -> None:
    rig = console.rig
    with rig.sessions.begin() as s:
        run = runs.open_run(s, tenant="acme", title="refunds")
        handle = run.handle
    op = made(rig, "op-77", order_id="B77", payee="P-payee-77", run=run)
    made(rig, "op-other", order_id="B78", payee="P-8")  # found by none of op-77's keys
    with rig.sessions.begin() as s:
        row = s.get(Operation, op.id)
        assert row is not None
        row.downstream_ref = "re_receipt_77"
    c = console.as_(VERA)
    for q, matched in [
        ("B77", "order id"),
        ("op-77", "op id"),
        (op.idempotency_key, "idempotency key"),
        (handle, "run handle"),
        ("P-payee-77", "payee"),
        ("re_receipt_77", "downstream reference"),
    ]:
        assert [(f["op"], f["matched"]) for f in searched(c, q)] == [("op-77", matched)], q


def test_the_reference_a_lookup_found_finds_the_operation(console: Console) -> None:
    """A receipt unlike the intent: the reference the lookup found is on no receipt of ours,
    yet it is what the downstream (and the customer's statement) shows."""
    rig = console.rig
    rig.control.add_rule("mismatched_receipt", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    rig.make_due(op)
    rig.reconciler().run_once()
    assert rig.op(op).downstream_ref is None and rig.reviews(op)
    reference = rig.downstream_reference(op)
    found = searched(console.as_(ANN), reference)
    assert [(f["op"], f["group"], f["matched"]) for f in found] == [
        ("op-1", "uncertain", "downstream reference")
    ]


def test_the_start_of_an_order_id_or_op_id_finds_it(console: Console) -> None:
    made(console.rig, "op-start-1", order_id="C10421")
    made(console.rig, "op-start-2", order_id="C10422")
    made(console.rig, "zz-9", order_id="D1")
    c = console.as_(VERA)
    assert {f["op"] for f in searched(c, "C1042")} == {"op-start-1", "op-start-2"}
    assert {f["matched"] for f in searched(c, "C1042")} == {"start of the order id"}
    assert [f["op"] for f in searched(c, "op-start-")] == ["op-start-2", "op-start-1"]
    assert [f["matched"] for f in searched(c, "zz-9")] == ["op id"]  # equal: not "start of"
    assert searched(c, "C1") == []  # under three characters: equal only
    assert searched(c, "10421") == []  # the start, not anywhere inside


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        ("A10%", set()),  # unescaped, it would find A1042
        ("%%%", set()),  # ... and everything
        ("___", set()),
        ("A1_4", {"op_u1"}),  # "_" is the character, not any one
        ("A1_", {"op_u1"}),
        ("op_u", {"op_u1"}),
        ("A10\\", set()),  # PostgreSQL's default escape character, as itself
        ("A1\\%", set()),
        ("A10/", set()),  # the escape character used, as itself
        ("A1/_", set()),
    ],
)
def test_like_wildcards_in_the_text_stand_for_themselves(
    console: Console, q: str, expected: set[str]
) -> None:
    made(console.rig, "opXu2", order_id="A1042")
    made(console.rig, "op_u1", order_id="A1_42x")
    assert {f["op"] for f in searched(console.as_(VERA), q)} == expected, q


def test_another_tenants_operation_is_never_found(console: Console) -> None:
    made(console.rig, "op-acme-1", order_id="E555", payee="P-acme")
    made(console.rig, "op-glob-1", tenant="globex", order_id="E556")
    c = console.as_(GLOBEX_ONLY)
    hidden = c.get("/console/find", q="E555").text
    missing = c.get("/console/find", q="E999").text
    assert hidden.replace("E555", "Q") == missing.replace("E999", "Q")  # like nothing at all
    assert 'id="nothing"' in hidden and "op-acme-1" not in hidden
    for q in ("op-acme-1", "op-acme", "P-acme", "E55"):
        assert [f["op"] for f in searched(c, q)] == ([] if q != "E55" else ["op-glob-1"]), q
    assert {f["op"] for f in searched(console.as_(VERA), "E55")} == {"op-acme-1", "op-glob-1"}


def test_many_matches_show_the_newest_and_say_there_are_more(console: Console) -> None:
    for n in range(52):
        made(console.rig, f"op-many-{n:02}", order_id="F1")
    page = console.as_(VERA).get("/console/find", q="F1").text
    found = rows(page)
    assert len(found) == 50 and found[0]["op"] == "op-many-51"
    assert 'id="more"' in page and "Showing the newest 50" in page
    assert 'id="more"' not in console.get("/console/find", q="op-many-51").text


@pytest.mark.parametrize("q", ["A1\x00042", "x" * 201, "A10\x1b[2J", "A1\x7f"])
def test_bad_text_is_refused_and_nothing_is_written(console: Console, q: str) -> None:
    made(console.rig, "op-bad", order_id="A1042")
    before = written(console.rig)
    r = console.as_(VERA).get("/console/find", q=q)
    assert r.status_code == 422 and "text/html" in r.headers["content-type"]
    assert "Invalid request" in r.text
    assert written(console.rig) == before


@pytest.mark.parametrize("q", ["", "   ", "x" * 201, "A1\x00042", "A1\n042", "A\t1"])
def test_the_service_refuses_bad_text_naming_the_field(console: Console, q: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        Finder(console.rig.sessions).search(VERA, q)
    assert refused.value.data["field"] == "q" and refused.value.code == "invalid_query"


def test_the_search_is_audited_without_the_text(
    console: Console, caplog: pytest.LogCaptureFixture
) -> None:
    made(console.rig, "op-aud", order_id="G-secret-order")
    with caplog.at_level("INFO", logger="settled.audit"):
        assert searched(console.as_(VERA), "G-secret-order")
    (record,) = [r for r in caplog.records if r.getMessage() == "console search"]
    assert record.__dict__["staff"] == "vera"
    assert "G-secret-order" not in str(record.__dict__)


def test_the_results_page_holds_no_inline_script_or_style_and_the_box_is_everywhere(
    console: Console,
) -> None:
    made(console.rig, "op-csp", order_id="H1")
    c = console.as_(VERA)
    page = c.get("/console/find", q="H1")
    assert page.headers["cache-control"] == "no-store"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text)
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page.text)
    for path in ("/console/review", "/console/overview", "/console/proposals", "/console/find",
                 "/console/operations/acme/op-csp"):  # fmt: skip
        assert re.search(
            r'<form class="search" method="get" action="/console/find"', c.get(path).text
        ), path
    # the old search by one key still answers
    old = c.get("/console/find", key="order_id", value="H1").text
    assert 'href="/console/operations/acme/op-csp"' in old and 'id="results"' not in old


def test_the_text_searched_for_is_escaped(console: Console) -> None:
    script = "<script>alert(1)</script>"
    page = console.as_(VERA).get("/console/find", q=script)
    assert page.status_code == 200 and script not in page.text
    assert "&lt;script&gt;" in page.text and 'id="nothing"' in page.text
