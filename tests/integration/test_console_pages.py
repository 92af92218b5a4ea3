"""The support console's pages over a real PostgreSQL database and the simulator: every page
and action by role, tenant limits, filters and pages, allowed choices, lost races, find,
overview, Chinese, escaping and the CSRF token. Sign-in is ``settled.console.auth``'s (tested
there); here ``current_user`` and ``require_csrf`` are overridden: a fixture signs in as a
given member of staff, and the CSRF check compares the form's token with the fixed one, so
the templates are proven to send it."""

from __future__ import annotations

import html
import re
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import HTTPException, Request
from sqlalchemy import Engine, select
from starlette.exceptions import StarletteDeprecationWarning

from outbox import runs
from outbox.kinds import default_registry
from outbox.models import Operation, OperationEvent, ReviewItem
from settled.console import auth, pages
from settled.console.auth import ConsoleUser, current_user, polled_user, require_csrf
from settled.web import create_web_app
from support.review import ReviewQueue
from support.staff import Staff
from tests.integration.test_review import in_review
from tests.support.rig import GOOD, Rig

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

CSRF = "fixed-csrf-token-for-tests"
ANN = Staff.parse("ann", "support")
BOB = Staff.parse("bob", "supervisor")
VERA = Staff.parse("vera", "viewer")
ADA = Staff.parse("ada", "admin")
GLOBEX_ONLY = Staff("gil", ANN.role, frozenset({"globex"}))


@pytest.fixture
def engine(pg: Engine) -> Engine:
    """PostgreSQL only: the pages' SQL is the services', tested on SQLite in their modules."""
    return pg


@dataclass
class Console:
    client: TestClient
    rig: Rig
    staff: Staff = ANN

    def as_(self, staff: Staff) -> Console:
        self.staff = staff
        return self

    def get(self, path: str, **params: Any) -> Any:
        return self.client.get(path, params=params or None)

    def post(self, path: str, data: dict[str, Any] | None = None, *, csrf: bool = True) -> Any:
        form = dict(data or {})
        if csrf:
            form["csrf_token"] = CSRF
        return self.client.post(path, data=form)


@pytest.fixture
def console(rig: Rig) -> Iterator[Console]:
    queue = ReviewQueue(rig.sessions, rig.gateway(), default_registry(), lookup_timeout=2.0)
    app = create_web_app(rig.sessions, review=queue)
    holder: list[Console] = []

    def signed_in() -> ConsoleUser:
        return ConsoleUser(holder[0].staff, CSRF)

    async def csrf(request: Request) -> None:
        form = await request.form()
        if form.get("csrf_token") != CSRF:
            raise HTTPException(403, "missing or wrong CSRF token")

    app.dependency_overrides[current_user] = signed_in
    app.dependency_overrides[polled_user] = signed_in
    app.dependency_overrides[require_csrf] = csrf
    with TestClient(app) as client:
        holder.append(Console(client, rig))
        yield holder[0]


def parked(
    rig: Rig, op_id: str, *, tenant: str = "acme", reason: str = "lookup_unavailable",
    age: timedelta = timedelta(0), params: dict[str, Any] | None = None,
) -> int:  # fmt: skip
    """An operation put in review by hand (nothing sent): fast, for lists and tenant limits."""
    rig.judged_by_ledger = False
    with rig.sessions.begin() as s:
        op = rig.outbox.enqueue(
            s, tenant=tenant, op_id=op_id, kind="refund", params=params or GOOD
        ).operation
        op.state = "unknown"
        op.unknown_since = datetime.now(UTC) - age
        item = ReviewItem(
            operation_id=op.id, tenant=tenant, reason=reason, evidence={"lookup": "unavailable"},
            created_at=datetime.now(UTC) - age,
        )  # fmt: skip
        s.add(item)
        s.flush()
        return item.id


def items_listed(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'href="/console/review/(\d+)"', page)]


# -- the queue: filters, pages, tenants ---------------------------------------------------


def test_queue_lists_open_items_oldest_first_with_amount(console: Console) -> None:
    newer = parked(console.rig, "op-new", age=timedelta(minutes=5))
    older = parked(console.rig, "op-old", age=timedelta(hours=2))
    r = console.as_(VERA).get("/console/review")
    assert r.status_code == 200
    assert items_listed(r.text) == [older, newer]
    assert "100.00 CNY" in r.text and "2 h 0 min" in r.text
    assert console.get("/console/").url.path == "/console/review"  # the home redirects


def test_queue_filters_by_tenant_reason_kind_and_age(console: Console) -> None:
    a = parked(console.rig, "op-a", age=timedelta(hours=2))
    b = parked(console.rig, "op-b", reason="past_key_retention")
    g = parked(console.rig, "op-g", tenant="globex")
    c = console.as_(VERA)
    assert items_listed(c.get("/console/review", tenant="globex").text) == [g]
    assert items_listed(c.get("/console/review", reason="past_key_retention").text) == [b]
    assert items_listed(c.get("/console/review", older_than=60).text) == [a]
    assert items_listed(c.get("/console/review", kind="ticket").text) == []
    assert items_listed(c.get("/console/review", kind="refund", tenant="acme").text) == [a, b]


def test_queue_pages_through_every_item_once(console: Console) -> None:
    ids = [parked(console.rig, f"op-{n:02}", age=timedelta(minutes=60 - n)) for n in range(30)]
    first = console.get("/console/review")
    assert items_listed(first.text) == ids[:25]
    assert "30 open item(s); showing 1 to 25" in first.text
    nxt = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert nxt is not None
    second = console.client.get(nxt.group(1).replace("&amp;", "&"))
    assert items_listed(second.text) == ids[25:]
    assert 'rel="next"' not in second.text


def test_a_limited_member_sees_nothing_of_other_tenants(console: Console) -> None:
    acme = parked(console.rig, "op-acme")
    globex = parked(console.rig, "op-glob", tenant="globex")
    c = console.as_(GLOBEX_ONLY)
    assert items_listed(c.get("/console/review").text) == [globex]
    assert items_listed(c.get("/console/review", tenant="acme").text) == []
    assert c.get(f"/console/review/{acme}").status_code == 404
    missing = c.get("/console/review/999999")
    assert missing.status_code == 404
    assert c.get(f"/console/review/{acme}").text == missing.text  # no oracle
    assert c.post(f"/console/review/{acme}/requery").status_code == 404
    resolved = c.post(f"/console/review/{acme}/resolve", {"outcome": "succeeded", "version": 1,
                                                          "reference": "re_x"})  # fmt: skip
    assert resolved.status_code == 404
    assert c.get("/console/operations/acme/op-acme").status_code == 404
    assert "op-acme" not in c.get("/console/find", key="order_id", value="A1042").text
    assert "op-glob" in c.get("/console/find", key="order_id", value="A1042").text
    assert c.get("/console/operations/globex/op-glob").status_code == 200
    with console.rig.sessions() as s:  # nothing recorded against the other tenant's item
        actors = s.scalars(select(OperationEvent.actor)).all()
    assert "staff:gil" not in actors


# -- an item: what it shows, and its actions by role ----------------------------------------


def timeline_of(page: str) -> list[tuple[str, int, str]]:
    """The timeline's entries: (what, count, its words), details left out."""
    body = page.split('<ol id="timeline">')[1].split("</ol>")[0]
    found = re.findall(
        r'data-what="(\w+)" data-count="(\d+)">.*?<span class="words">([^<]*)</span>', body, re.S
    )
    return [(what, int(count), html.unescape(words)) for what, count, words in found]


def lead_of(page: str) -> str:
    (said,) = re.findall(r'<p id="lead" class="lead">([^<]*)</p>', page)
    return html.unescape(said)


def test_item_page_shows_attempts_lookups_events_and_evidence(console: Console) -> None:
    _op, item = in_review(console.rig)
    r = console.as_(VERA).get(f"/console/review/{item}")
    assert r.status_code == 200
    assert "lookup_unavailable" in r.text
    assert timeline_of(r.text) == [
        ("created", 1, "Asked for by intake: planned"),
        ("sent", 1, "Attempt 1 sent by w1"),  # the one attempt
        ("no_answer", 1, "No answer to the attempt (the answer timed out): the outcome is unknown"),
        ("look", 1, "reconciler:r1 looked it up: the lookup was unavailable (lookup answered "
                    "HTTP 503); put in review: the lookup stayed unavailable too long"),
    ]  # fmt: skip
    attempts = r.text.split('id="attempts">')[1].split("</pre>")[0]  # its record, in details
    assert (
        attempts.count("&#34;number&#34;: 1") == 1 and "&#34;proof&#34;: &#34;unknown" in attempts
    )
    evidence = r.text.split('id="evidence">')[1].split("</pre>")[0]
    assert "&#34;detail&#34;: &#34;lookup answered HTTP 503&#34;" in evidence
    # a viewer sees no action at all
    assert 'id="actions"' not in r.text and "/requery" not in r.text and "/resolve" not in r.text


def test_the_item_page_leads_with_the_sentence_naming_order_amount_and_payee(
    console: Console,
) -> None:
    _op, item = in_review(console.rig)
    page = console.as_(ANN).get(f"/console/review/{item}").text
    assert lead_of(page) == (
        "Refund of 100.00 CNY to payee P-7 for order A1042: the payment service's answer is "
        "unknown (the lookup was unavailable); look it up again now, or ask a supervisor."
    )
    assert page.index('id="lead"') < page.index("<h2>")  # first, under the heading
    supervisor = lead_of(console.as_(BOB).get(f"/console/review/{item}").text)
    assert supervisor.endswith("as a supervisor you may resolve it below with a justification.")
    zh = lead_of(console.as_(VERA).get(f"/console/review/{item}", lang="zh").text)
    assert zh == (
        "订单 A1042 向收款方 P-7 退款 100.00 CNY：支付服务的回答未知（查询服务不可用）；"
        "您可以查看；由客服处理。"
    )
    operation = console.get("/console/operations/acme/op-1", lang="en").text
    assert lead_of(operation).endswith(
        f"support staff resolve it in review item #{item}; no time is promised until they do."
    )


def test_five_reconcile_passes_are_one_folded_line_with_their_count(console: Console) -> None:
    rig = console.rig
    op, item = in_review(rig)
    for _ in range(5):  # each pass looks again, finds the lookup down again: nothing new
        rig.make_due(op)
        rig.control.add_rule("lookup_unavailable", times=1)
        assert rig.reconciler().run_once().outcomes == {"in_review": 1}
    page = console.as_(VERA).get(f"/console/review/{item}").text
    looks = [e for e in timeline_of(page) if e[0] == "look"]
    assert looks[-1] == (
        "look", 5, "reconciler:r1 looked it up 5 times, nothing new: the lookup was unavailable "
        "(lookup answered HTTP 503); still in review"
    )  # fmt: skip
    assert len(looks) == 2  # "put in review", then the five passes as one line
    folded = page.split('data-count="5">')[1].split("</li>")[0]
    assert re.search(r"\(first <time [^>]+>[^<]+</time>, last <time [^>]+>[^<]+</time>\)", folded)
    with rig.sessions() as s:  # every pass is still an event row: folded on the page only
        rows = s.scalars(select(OperationEvent).where(OperationEvent.reason == "in_review"))
        assert len(list(rows)) == 5
    zh = console.get(f"/console/review/{item}", lang="zh").text
    assert "reconciler:r1 查询 5 次，无新情况" in timeline_of(zh)[-1][2]


def _item_and_operation_pages(console: Console) -> list[str]:
    _op, item = in_review(console.rig)
    console.as_(ANN).post(f"/console/review/{item}/requery")  # resolved: a time more to show
    return [
        console.get(f"/console/review/{item}").text,
        console.get("/console/operations/acme/op-1").text,
        console.get(f"/console/review/{item}", lang="zh").text,
    ]


def test_no_time_on_the_pages_has_microseconds_and_each_is_a_time_element(
    console: Console,
) -> None:
    for page in _item_and_operation_pages(console):
        assert not re.search(r"\d\d:\d\d:\d\d\.\d", page)  # no fraction of a second
        assert "+00:00" not in page
        stamps = re.findall(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d", page)
        times = re.findall(r'<time(?: class="exact")? datetime="([^"]+)" title="([^"]+)">', page)
        assert len(times) >= 8  # created, deadline, unknown since, each timeline entry
        for machine, _title in times:
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", machine)
        assert any(title.endswith(" UTC") for _m, title in times)
        assert stamps  # times are there, to the second


def test_no_other_page_shows_a_fraction_of_a_second(console: Console) -> None:
    """The queue, the overview (with a reconcile pass), the search and the find by one key."""
    _op, _item = in_review(console.rig)
    pages = [
        console.as_(ANN).get("/console/review").text,
        console.get("/console/overview").text,
        console.get("/console/find", q="A1042").text,
        console.get("/console/find", key="order_id", value="A1042").text,
    ]
    for page in pages:
        assert not re.search(r"\d\d:\d\d:\d\d\.\d", page) and "+00:00" not in page
    assert '<time datetime="' in pages[1] and '<time datetime="' in pages[3]


def test_raw_json_is_only_inside_details(console: Console) -> None:
    for page in _item_and_operation_pages(console):
        main = page.split("<main>")[1]
        assert "<details" in main and "<pre" in main
        outside = re.sub(r"<details\b.*?</details>", "", main, flags=re.S)
        assert "<pre" not in outside
        assert "&#34;" not in outside and "{" not in outside  # no JSON left in plain sight
        for block in re.findall(r"<details\b.*?</details>", main, flags=re.S):
            assert re.match(r'<details class="raw"[^>]*><summary>(Details|详情)</summary>', block)


def test_a_viewer_is_refused_every_action(console: Console) -> None:
    op, item = in_review(console.rig)
    c = console.as_(VERA)
    assert c.post(f"/console/review/{item}/requery").status_code == 403
    r = c.post(f"/console/review/{item}/resolve", {"outcome": "succeeded", "version": 1,
                                                   "reference": "re_x"})  # fmt: skip
    assert r.status_code == 403
    assert "You may not do this." in r.text
    assert console.rig.op(op).state == "unknown"


def test_support_sees_only_a_requery_when_the_lookup_was_down(console: Console) -> None:
    _op, item = in_review(console.rig)
    r = console.as_(ANN).get(f"/console/review/{item}")
    assert "/requery" in r.text and 'id="no-choices"' in r.text
    assert 'class="resolve"' not in r.text  # "unavailable": only a supervisor's override
    for boss in (BOB, ADA):
        page = console.as_(boss).get(f"/console/review/{item}").text
        forms = re.findall(r'data-outcome="(\w+)" data-override="(\w+)"', page)
        assert forms == [("succeeded", "true"), ("rejected", "true")]


def test_the_item_page_says_what_a_rejected_on_not_found_would_rest_on(
    console: Console,
) -> None:
    """The console's downstream here declares no fence: a "not found" rests on the delay
    bound, and the page says how long it is."""
    _op, item = in_review(console.rig)
    page = console.as_(ANN).get(f"/console/review/{item}").text
    (said,) = re.findall(r'<p id="rests-on">([^<]*)</p>', page)
    assert "more than 300 s late" in said


def test_requery_settles_the_item_and_is_audited(console: Console) -> None:
    op, item = in_review(console.rig)
    r = console.as_(ANN).post(f"/console/review/{item}/requery")
    assert r.status_code == 200
    assert "The lookup found it: the operation is now succeeded." in r.text
    assert "Resolved by ann at" in r.text and 'id="actions"' not in r.text
    assert console.rig.op(op).state == "succeeded"
    assert console.rig.reviews(op)[0].resolved_by == "staff:ann"


def test_a_requery_that_finds_nothing_new_says_so_in_words(console: Console) -> None:
    op, item = in_review(console.rig)
    console.rig.control.add_rule("lookup_unavailable", times=1)
    page = console.as_(ANN).post(f"/console/review/{item}/requery").text
    assert "Looked up again (the lookup was unavailable): the operation stays unknown." in page
    assert "The last lookup: the lookup was unavailable." in page
    assert "'unavailable'" not in page
    assert console.rig.op(op).state == "unknown"


def test_resolve_then_a_second_resolve_is_told_who_won(console: Console) -> None:
    op, item = in_review(console.rig)
    ref = console.rig.downstream_reference(op)
    form = {"outcome": "succeeded", "version": 1, "reference": ref, "override": "true",
            "justification": "checked with the provider's dashboard"}  # fmt: skip
    won = console.as_(BOB).post(f"/console/review/{item}/resolve", form)
    assert "Resolved: the operation is now succeeded." in won.text
    lost = console.as_(ADA).post(f"/console/review/{item}/resolve", form)
    assert lost.status_code == 200  # a message on the page, not an error page
    assert re.search(r"Already resolved by bob at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\.", lost.text)
    assert console.rig.op(op).state == "succeeded"
    with console.rig.sessions() as s:
        refused = s.scalars(
            select(OperationEvent.actor).where(OperationEvent.reason == "staff_refused")
        ).all()
    assert refused == ["staff:ada"]


def test_a_contradiction_is_a_message_and_writes_nothing(console: Console) -> None:
    op, item = in_review(console.rig)
    form = {"outcome": "rejected", "version": 1, "override": "true",
            "justification": "customer says it never arrived"}  # fmt: skip
    r = console.as_(BOB).post(f"/console/review/{item}/resolve", form)
    assert r.status_code == 200
    assert "Refused: the downstream&#39;s lookup (found) contradicts" in r.text
    assert console.rig.op(op).state == "unknown"


def test_a_form_without_the_csrf_token_is_refused(console: Console) -> None:
    op, item = in_review(console.rig)
    assert console.as_(ANN).post(f"/console/review/{item}/requery", csrf=False).status_code == 403
    form = {"outcome": "succeeded", "version": 1, "reference": "re_x"}
    r = console.post(f"/console/review/{item}/resolve", form, csrf=False)
    assert r.status_code == 403
    assert console.rig.op(op).state == "unknown"
    assert console.rig.reviews(op)[0].resolved_at is None
    page = console.get(f"/console/review/{item}").text  # every form that posts sends it
    assert page.count('method="post"') == page.count(f'name="csrf_token" value="{CSRF}"')
    assert page.count("<form") == page.count('method="post"') + page.count('method="get"')
    search = page.split('<form class="search"')[1].split("</form>")[0]
    assert 'method="get"' in search and "csrf_token" not in search  # never in a URL


# -- find, operation, overview --------------------------------------------------------------


def test_find_by_each_key_and_the_operation_page(console: Console) -> None:
    console.rig.judged_by_ledger = False
    with console.rig.sessions.begin() as s:
        run = runs.open_run(s, tenant="acme", title="refund order A77")
        op = console.rig.outbox.enqueue(
            s, tenant="acme", op_id="op-77", kind="refund", params={**GOOD, "order_id": "A77"},
            run=run,
        ).operation  # fmt: skip
        handle, key = run.handle, op.idempotency_key
    c = console.as_(VERA)
    for params in ({"key": "op_id", "tenant": "acme", "value": "op-77"},
                   {"key": "order_id", "value": "A77"},
                   {"key": "idempotency_key", "value": key},
                   {"key": "run", "value": handle}):  # fmt: skip
        r = c.get("/console/find", **params)
        assert r.status_code == 200
        assert 'href="/console/operations/acme/op-77"' in r.text, params
    assert 'id="nothing"' in c.get("/console/find", key="order_id", value="A78").text
    assert c.get("/console/find", key="op_id", value="op-77").status_code == 422  # no tenant
    page = c.get("/console/operations/acme/op-77")
    assert "Not done" in page.text and "has not been sent yet." in page.text
    assert handle in page.text and "refund order A77" in page.text
    zh = c.get("/console/operations/acme/op-77", lang="zh")
    assert "未完成" in zh.text and "尚未发送" in zh.text
    assert c.get("/console/operations/acme/op-78").status_code == 404


def test_an_uncertain_operation_is_reported_in_the_run_reports_words(console: Console) -> None:
    op, item = in_review(console.rig)
    r = console.as_(VERA).get("/console/operations/acme/op-1")
    assert "Uncertain" in r.text
    assert "still pending confirmation; support staff are checking it." in r.text
    assert f'href="/console/review/{item}"' in r.text
    assert console.rig.op(op).state == "unknown"


#: far enough ahead that the reconciler's next look is past quiescence and review threshold
NEXT_LOOK = datetime(2099, 1, 1, 12, 0, tzinfo=UTC)
DECIDED_BY = "2099-01-01 12:00:20 UTC"  # that look, a beat period and a lookup later


def unknown_op(rig: Rig, op_id: str) -> None:
    """An operation whose answer was lost (nothing sent, for speed), looked at again at
    ``NEXT_LOOK``."""
    rig.judged_by_ledger = False
    with rig.sessions.begin() as s:
        op = rig.outbox.enqueue(
            s, tenant="acme", op_id=op_id, kind="refund", params={**GOOD, "order_id": "A88"}
        ).operation
        op.state = "unknown"
        op.unknown_since = datetime.now(UTC)
        op.next_attempt_at = NEXT_LOOK


def test_an_uncertain_operation_says_what_it_waits_for_and_by_when(console: Console) -> None:
    unknown_op(console.rig, "op-88")
    c = console.as_(VERA)
    page = c.get("/console/operations/acme/op-88", lang="en").text
    assert lead_of(page).endswith(
        'the reconciler waits until no late request can still land before it trusts a "not '
        f'found": it is decided, or put in review, by {DECIDED_BY} at the latest; nothing to '
        "do yet."
    )
    assert f"decided by {DECIDED_BY} at the latest, or handed to support staff." in page
    zh = c.get("/console/operations/acme/op-88", lang="zh").text
    assert lead_of(zh).endswith(f"最迟于 {DECIDED_BY} 得出结论或转入待处理；暂时无需操作。")
    assert f"最迟于 {DECIDED_BY} 得出结论，或转交客服人员处理。" in zh
    for params in ({"key": "op_id", "tenant": "acme", "value": "op-88"}, {"q": "A88"}):
        row = c.get("/console/find", lang="en", **params).text
        assert "decided by" in row and 'datetime="2099-01-01T12:00:20Z"' in row, params
        assert f">{DECIDED_BY}</time> at the latest" in row, params
        row_zh = c.get("/console/find", lang="zh", **params).text
        assert "最迟于 <time" in row_zh and f">{DECIDED_BY}</time> 得出结论" in row_zh, params


def test_an_operation_in_review_waits_for_staff_with_no_time_promised(console: Console) -> None:
    parked(console.rig, "op-r1", params={**GOOD, "order_id": "A99"})
    c = console.as_(VERA)
    assert "waits for staff, no time promised" in c.get("/console/find", q="A99").text
    assert "等待客服处理，无法承诺时间" in c.get("/console/find", q="A99", lang="zh").text
    zh = lead_of(c.get("/console/operations/acme/op-r1", lang="zh").text)
    assert zh.endswith("处理完成前无法承诺具体时间。")


def test_overview_counts_what_was_created(console: Console) -> None:
    parked(console.rig, "op-u1", age=timedelta(minutes=30))
    parked(console.rig, "op-u2", tenant="globex")
    with console.rig.sessions.begin() as s:
        console.rig.outbox.enqueue(s, tenant="acme", op_id="op-p", kind="refund", params=GOOD)
    r = console.as_(VERA).get("/console/overview")
    assert r.status_code == 200
    assert 'data-state="unknown">2<' in r.text and 'data-state="planned">1<' in r.text
    assert "Open review items: 2" in r.text
    assert re.search(r"Oldest unknown: (1[89]\d\d) s", r.text)  # about 30 minutes
    assert "<svg" in r.text
    limited = console.as_(GLOBEX_ONLY).get("/console/overview").text
    assert 'data-state="unknown">1<' in limited and "planned" not in limited


def test_overview_charts_what_settled(console: Console) -> None:
    op, item = in_review(console.rig)
    console.as_(ANN).post(f"/console/review/{item}/requery")
    r = console.get("/console/overview")
    assert "Settled per minute (last hour): 1 in all" in r.text
    settled = svg(r.text, "chart-settled")
    bars = [e for e in settled.iter(f"{SVG}rect") if e.get("class") == "bar"]
    assert len(bars) == 60
    assert [float(b.get("height", 0)) > 0 for b in bars].count(True) == 1
    tallest = max(bars, key=lambda b: float(b.get("height", 0)))
    assert tallest.findtext(f"{SVG}title") == "1"  # the one minute with a settlement
    assert "reconciler:" in r.text.split('id="passes"')[1]
    assert console.rig.op(op).state == "succeeded"


# -- language and escaping -----------------------------------------------------------------


def test_chinese_is_chosen_by_query_and_kept_in_a_cookie(console: Console) -> None:
    parked(console.rig, "op-zh")
    r = console.as_(VERA).get("/console/review", lang="zh")
    assert "待处理队列" in r.text and 'lang="zh"' in r.text
    assert console.client.cookies.get("lang") == "zh"
    assert "待处理队列" in console.get("/console/overview").text
    assert "Review queue" in console.get("/console/review", lang="en").text


def test_user_controlled_text_is_escaped(console: Console) -> None:
    script = "<script>alert(1)</script>"
    item = parked(console.rig, "op-x")
    with console.rig.sessions.begin() as s:
        row = s.get(ReviewItem, item)
        assert row is not None
        row.evidence = {"detail": script}
        op = s.get(Operation, row.operation_id)
        assert op is not None
        op.correlation_id = script
        run = runs.open_run(s, tenant="acme", title=script)
        op.run_id = run.id
    c = console.as_(VERA)
    pages = [
        c.get(f"/console/review/{item}").text,
        c.get("/console/review", tenant=script).text,
        c.get("/console/find", key="order_id", value=script).text,
        c.get("/console/operations/acme/op-x").text,
    ]
    for page in pages:
        assert script not in page
    assert "&lt;script&gt;" in pages[1] and "&lt;script&gt;" in pages[3]


# -- what every answer sends, and requests no row can answer ---------------------------------


def _console_gets(console: Console) -> list[str]:
    """A path for every GET route under /console (a new page is checked the day it lands)."""
    op, item = in_review(console.rig)
    tenant, op_id = console.rig.op(op).tenant, console.rig.op(op).op_id
    values = {"item_id": str(item), "tenant": tenant, "op_id": op_id, "proposal_id": "1"}
    paths = [
        "/console/static/console.css",
        "/console/static/htmx.min.js",
        "/console/static/times.js",
    ]
    for route in [*pages.router.routes, *auth.router.routes]:
        path = getattr(route, "path", "")
        if path.startswith("/console") and "GET" in getattr(route, "methods", ()):
            paths.append(re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path))
    return paths


def test_every_console_answer_sends_the_security_headers(console: Console) -> None:
    paths = _console_gets(console)
    assert {"/console/review", "/console/find", "/console/login"} <= set(paths)
    for path in [*paths, "/console/review/999999", "/console/nowhere"]:
        r = console.client.get(path, follow_redirects=False)
        assert r.status_code < 500, path
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
        assert "'unsafe-inline'" not in csp
        assert r.headers["x-frame-options"] == "DENY", path
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert r.headers["referrer-policy"] == "same-origin", path
        if not path.startswith("/console/static/"):
            assert r.headers["cache-control"] == "no-store", path  # customer data: never cached
    r = console.post("/console/review/1/requery")  # a form's answer too
    assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"


def test_pages_hold_no_inline_script_or_style(console: Console) -> None:
    """The CSP allows none: anything inline would be blocked in the browser."""
    for path in _console_gets(console):
        if path.startswith("/console/static/"):
            continue
        page = console.client.get(path).text
        assert not re.search(r"<script(?![^>]*\bsrc=)", page), path
        assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page), path


@pytest.mark.parametrize(
    "path",
    [
        "/console/review/99999999999999999999",
        "/console/review/9223372036854775808",
        "/console/review/-1",
        "/console/review/abc",
        "/console/proposals/99999999999999999999",
        "/console/proposals/x",
    ],
)
def test_an_id_no_row_can_have_is_the_missing_page(console: Console, path: str) -> None:
    r = console.get(path)
    assert r.status_code == 404 and "text/html" in r.headers["content-type"]
    post = path + ("/requery" if "/review/" in path else "/approve")
    assert console.post(post).status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/console/operations/acme/op%00x",
        "/console/operations/ac%00me/op-1",
        "/console/find?key=order_id&value=A1%00042",
        "/console/find?key=op_id&value=op-1&tenant=ac%00me",
        "/console/review?tenant=ac%00me",
        "/console/review?reason=%00",
        "/console/review/1?x=%00",
    ],
)
def test_a_nul_in_a_path_or_query_is_refused_as_bad_input(console: Console, path: str) -> None:
    r = console.client.get(path)
    assert r.status_code == 422 and "text/html" in r.headers["content-type"], r.text[:200]
    assert "NUL" in r.text
    assert r.headers["cache-control"] == "no-store"


def test_a_nul_in_a_resolve_form_is_refused_and_writes_nothing(console: Console) -> None:
    op, item = in_review(console.rig)
    before = console.rig.op(op).version if hasattr(console.rig.op(op), "version") else None
    r = console.as_(BOB).post(
        f"/console/review/{item}/resolve",
        {"outcome": "rejected", "version": 1, "override": "true",
         "justification": "checked with the bank\x00 twice"},
    )  # fmt: skip
    assert r.status_code == 200 and "NUL" in r.text
    assert console.rig.op(op).state == "unknown"
    assert before == (console.rig.op(op).version if before is not None else None)


def test_a_mismatch_item_shows_the_record_the_lookup_found(console: Console) -> None:
    rig = console.rig
    rig.control.add_rule("mismatched_receipt", times=1)
    op = rig.enqueue()
    rig.executor().execute([op])
    rig.make_due(op)
    rig.reconciler().run_once()
    (item,) = rig.reviews(op)
    page = console.as_(ANN).get(f"/console/review/{item.id}").text
    reference = rig.downstream_reference(op)
    assert reference in page.split('id="found-record"')[1].split("</p>")[0]
    forms = re.findall(r'data-outcome="(\w+)" data-override="(\w+)"', page)
    assert forms == [("succeeded", "false")]  # the record proves it was made: no "rejected"
    assert f'name="reference" required maxlength="200" value="{reference}"' in page


# -- the live queue and item, names in both languages, the overview's charts ----------------

SVG = "{http://www.w3.org/2000/svg}"


def svg(page: str, chart_id: str) -> ET.Element:
    """The ``<svg id=chart_id>`` of a page, parsed (the charts are well-formed SVG)."""
    start = page.index(f'<svg id="{chart_id}"')
    drawn = page[start : page.index("</svg>", start) + len("</svg>")]
    return ET.fromstring(drawn.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1))


def texts(element: ET.Element, classes: str) -> list[str]:
    """The texts in ``element`` that have every one of ``classes``."""
    wanted = set(classes.split())
    return [
        e.text or ""
        for e in element.iter(f"{SVG}text")
        if wanted <= set(e.get("class", "").split())
    ]


def test_queue_rows_show_order_amount_payee_plain_reason_and_the_operation(
    console: Console,
) -> None:
    item = parked(console.rig, "op-row", reason="lookup_mismatch",
                  params={**GOOD, "order_id": "A7777", "amount_minor": 12345})  # fmt: skip
    page = console.as_(VERA).get("/console/review").text
    row = page.split(f'<tr data-item="{item}">')[1].split("</tr>")[0]
    assert '<td class="order">A7777</td>' in row
    assert '<td class="amount">123.45 CNY</td>' in row
    assert '<td class="payee">P-7</td>' in row
    assert "The lookup found a record that differs from the request" in row
    assert ">lookup_mismatch<" not in row  # the code is data, not what staff read
    assert 'href="/console/operations/acme/op-row"' in row
    assert f'href="/console/review/{item}"' in row
    assert console.get("/console/operations/acme/op-row").status_code == 200


def test_a_reason_code_without_words_is_shown_as_it_is(console: Console) -> None:
    item = parked(console.rig, "op-odd", reason="some_new_reason")
    page = console.as_(VERA).get("/console/review").text
    row = page.split(f'<tr data-item="{item}">')[1].split("</tr>")[0]
    assert '<td class="reason" data-reason="some_new_reason">some_new_reason</td>' in row


def test_state_and_reason_names_are_chinese_in_zh(console: Console) -> None:
    item = parked(console.rig, "op-zh")
    with console.rig.sessions.begin() as s:
        console.rig.outbox.enqueue(s, tenant="acme", op_id="op-zh-p", kind="refund", params=GOOD)
    c = console.as_(ANN)
    queue = c.get("/console/review", lang="zh").text
    assert '<td data-state="unknown">结果未知</td>' in queue
    assert "对方服务的查询接口不可用" in queue  # lookup_unavailable, in words
    overview = c.get("/console/overview").text  # the cookie keeps zh
    assert "<td>待发送</td>" in overview and "<td>结果未知</td>" in overview
    assert "分钟前" in overview and "完成耗时中位数" in overview
    status = c.get(f"/console/review/{item}/status").text
    assert "待客服处理；操作状态：结果未知。" in status
    assert "unknown" not in status.replace('data-state="unknown"', "")
    english = c.get("/console/review", lang="en").text
    assert '<td data-state="unknown">unknown</td>' in english


def test_overview_charts_have_axes_ticks_titles_and_a_legend(console: Console) -> None:
    op, item = in_review(console.rig)
    console.as_(ANN).post(f"/console/review/{item}/requery")
    page = console.get("/console/overview").text
    settled, seconds = svg(page, "chart-settled"), svg(page, "chart-seconds")
    for chart, y_label in [(settled, "operations"), (seconds, "seconds")]:
        assert chart.get("role") == "img" and chart.get("aria-labelledby")
        assert chart.findtext(f"{SVG}title") and chart.findtext(f"{SVG}desc")
        axes = [e for e in chart.iter(f"{SVG}line") if e.get("class") == "axis"]
        assert len(axes) == 2  # x and y
        assert texts(chart, "axis-label") == ["minutes ago", y_label]
        assert texts(chart, "tick-label x") == ["50", "40", "30", "20", "10", "0"]
        y_ticks = [float(v) for v in texts(chart, "tick-label y")]
        assert y_ticks[0] == 0 and y_ticks == sorted(y_ticks) and len(y_ticks) >= 2
        assert texts(chart, "chart-title")
    assert texts(settled, "legend-label") == ["settled in that minute"]
    assert texts(seconds, "legend-label") == ["median time to settle", "95th percentile"]
    assert float(texts(settled, "tick-label y")[-1]) >= 1  # the top holds the one settled
    median = [e for e in seconds.iter(f"{SVG}circle") if "median" in e.get("class", "")]
    assert len(median) == 1  # one minute settled something: one point
    table = page.split('id="chart-table"')[1].split("</details>")[0]
    assert "<summary>" in table and table.count("<tr>") == 2  # the head and that minute
    assert console.rig.op(op).state == "succeeded"


def test_the_queue_and_the_item_poll_their_fragments_and_leave_the_forms_alone(
    console: Console,
) -> None:
    op, item = in_review(console.rig)
    c = console.as_(BOB)
    queue = c.get("/console/review", tenant="acme").text
    polled = re.search(r'<div id="queue-list" hx-get="([^"]+)" hx-trigger="every 10s"', queue)
    assert polled is not None and "tenant=acme" in polled.group(1)
    fragment = c.get(polled.group(1).replace("&amp;", "&"))
    assert fragment.status_code == 200 and "<html" not in fragment.text
    assert items_listed(fragment.text) == [item]
    page = c.get(f"/console/review/{item}").text
    status = page.split('<div id="item-status"')[1].split("</div>")[0]
    assert f'hx-get="/console/review/{item}/status" hx-trigger="every 10s"' in status
    assert "<form" not in status and "<textarea" not in status  # the forms are never swapped
    assert "<form" in page.split('<div id="item-status"')[1]  # they sit after it
    r = c.get(f"/console/review/{item}/status")
    assert r.status_code == 200 and "<html" not in r.text and "<form" not in r.text
    assert 'data-resolved="false"' in r.text
    c.post(f"/console/review/{item}/requery")  # settled: the next poll says so
    r = c.get(f"/console/review/{item}/status")
    assert 'data-resolved="true"' in r.text and "Resolved by bob at" in r.text
    assert console.rig.op(op).state == "succeeded"


def test_the_fragments_honour_tenant_limits(console: Console) -> None:
    acme = parked(console.rig, "op-a")
    globex = parked(console.rig, "op-g", tenant="globex")
    c = console.as_(GLOBEX_ONLY)
    assert items_listed(c.get("/console/queue").text) == [globex]
    assert items_listed(c.get("/console/queue", tenant="acme").text) == []
    r = c.get(f"/console/review/{acme}/status")
    assert r.status_code == 404 and "op-a" not in r.text
    assert c.get("/console/review/999999/status").status_code == 404
    assert c.get(f"/console/review/{globex}/status").status_code == 200


def test_the_fragments_need_a_signed_in_member_of_staff(console: Console) -> None:
    item = parked(console.rig, "op-s")
    overrides = console.client.app.dependency_overrides  # type: ignore[attr-defined]
    overrides.pop(current_user), overrides.pop(polled_user)
    for path in ["/console/queue", f"/console/review/{item}/status"]:
        r = console.client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        htmx = {"HX-Request": "true", "HX-Current-URL": "http://testserver/console/review"}
        r = console.client.get(path, headers=htmx, follow_redirects=False)
        assert r.status_code == 401 and r.headers["hx-redirect"].startswith("/console/login")
        assert "op-s" not in r.text


def test_an_orphan_effects_item_is_in_the_queue_in_its_words_and_its_page_says_why(
    console: Console,
) -> None:
    console.rig.judged_by_ledger = False
    with console.rig.sessions.begin() as s:
        evidence = {"reference": "re_lost", "op_id": None, "idempotency_key": "stl_x",
                    "amount_minor": 700, "currency": "CNY"}  # fmt: skip
        item = ReviewItem(operation_id=None, effect="http:acme:re_lost", tenant="acme",
                          reason="orphan_effect", evidence=evidence)  # fmt: skip
        s.add(item)
        s.flush()
        item_id = item.id
    r = console.as_(VERA).get("/console/review")
    assert r.status_code == 200 and items_listed(r.text) == [item_id]
    assert "Done at the service, but no operation here" in r.text and "7.00 CNY" in r.text
    assert 'class="operation"' not in r.text  # no operation to link to
    page = console.get(f"/console/review/{item_id}")
    assert "this item is an orphan effect" in page.text
