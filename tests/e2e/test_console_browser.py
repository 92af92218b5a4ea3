"""The support console in a real browser: Playwright (sync API) driving Debian's chromium
against a real ``settled web`` process, the test's PostgreSQL database and the simulator.

Review items are made the way ``tests/integration/test_review.py`` makes them (a send that
commits and then times out, the lookup down), in this process, before the browser opens the
queue. Every wait is Playwright's auto-waiting ``expect``. Each main page is photographed into
``test-artifacts/console/`` (``scripts/console_screenshots.sh`` copies them into
``docs/console/``, which docs/support.md shows).

Without ``/usr/bin/chromium`` the module is skipped, unless ``SETTLED_TEST_REQUIRE_BROWSER`` is set
(as in ``.ci/run``): then a missing browser is a failure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from outbox.models import Operation
from support.accounts import create_account
from support.review import ReviewQueue
from support.staff import Staff
from tests.support.agents import REFUND, call, converse, server
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.services import free_port
from tests.support.simtools import wait_until
from tests.support.stack import Stack

CHROMIUM = Path("/usr/bin/chromium")
REQUIRED = bool(os.environ.get("SETTLED_TEST_REQUIRE_BROWSER"))
if not CHROMIUM.exists() and not REQUIRED:
    pytest.skip(
        "no /usr/bin/chromium (apt-get install chromium; SETTLED_TEST_REQUIRE_BROWSER=1 makes this "
        "a failure)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, ViewportSize, expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
PASSWORD = "a long enough password"
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("SETTLED_TEST_REQUIRE_BROWSER is set and /usr/bin/chromium is missing")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def engine(pg: Engine) -> Engine:
    """PostgreSQL: the ``settled web`` process and this test share the database."""
    return pg


@pytest.fixture
def console(rig: Rig, pg_url: str, tmp_path: Path) -> Iterator[str]:
    """A ``settled web`` process over the rig's database and simulator: its base URL."""
    yield from _web(rig, pg_url, tmp_path)


@pytest.fixture
def live_console(rig: Rig, pg_url: str, tmp_path: Path) -> Iterator[str]:
    """``console`` polling every second (``SETTLED_CONSOLE_REFRESH_SECONDS``), so a test sees
    a refresh cycle soon: the default is 10 s."""
    yield from _web(rig, pg_url, tmp_path, SETTLED_CONSOLE_REFRESH_SECONDS="1")


def _web(rig: Rig, pg_url: str, tmp_path: Path, **env: str) -> Iterator[str]:
    stack = Stack(
        database_url=pg_url,
        broker_url="redis://127.0.0.1:1/0",  # web publishes nothing in these tests
        downstream_url=rig.url,
        api_keys={rig.tenant.name: rig.tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    web = stack.start("web", "--host=127.0.0.1", f"--port={port}", **env)
    try:
        wait_until(lambda: _up(base) or web.poll() is not None, 60, "settled web")
        assert web.poll() is None, stack.log_of(web)[-4000:]
        yield base
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop_all()


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def stuck(rig: Rig, op_id: str) -> tuple[int, int]:
    """An operation whose send committed and then timed out, with the lookup down: in review."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue(op_id)
    rig.executor().execute([op])
    assert rig.op(op).state == "unknown"
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    rig.reconciler().run_once()
    (item,) = rig.reviews(op)
    return op, item.id


def add_staff(rig: Rig, name: str, role: str) -> None:
    with rig.sessions.begin() as s:
        create_account(s, name=name, password=PASSWORD, role=role)


def signed_in(
    browser: Browser, base: str, name: str, *, shoot: bool = False, zone: str | None = None
) -> Page:
    """A fresh browser context signed in as ``name`` through the sign-in form (its clocks in
    time zone ``zone``, where given)."""
    page = browser.new_context(viewport=VIEWPORT, timezone_id=zone).new_page()
    page.goto(f"{base}/console/review")
    expect(page).to_have_url(re.compile(r"/console/login\?next=/console/review$"))
    page.get_by_label("Staff name").fill(name)
    page.get_by_label("Password").fill(PASSWORD)
    if shoot:
        shot(page, "login")
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{base}/console/review")
    expect(page.locator(".who")).to_contain_text(f"Signed in as {name}")
    return page


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_support_finds_requeries_and_sees_it_settled_and_audited(
    rig: Rig, console: str, browser: Browser
) -> None:
    op, item = stuck(rig, "op-1")
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann", shoot=True)

    listed = page.locator(f'a[href="/console/review/{item}"]')
    expect(listed).to_be_visible()
    row = page.locator(f'#queue tr[data-item="{item}"]')
    expect(row).to_contain_text("A1042")  # the order, the amount, the reason in words
    expect(row).to_contain_text("100.00 CNY")
    expect(row.locator("td.reason")).to_have_text("The service's lookup was unavailable")
    expect(row.locator("a.operation")).to_have_attribute("href", "/console/operations/acme/op-1")
    shot(page, "queue")
    listed.click()
    expect(page.get_by_role("heading", name=f"Review item #{item}")).to_be_visible()
    expect(page.locator("#no-choices")).to_be_visible()  # the lookup was down: no resolving
    shot(page, "item")

    # the lookup is back (its fault was used once): ask again now
    page.get_by_role("button", name="Look it up again now").click()
    expect(page.get_by_role("status")).to_have_text(
        "The lookup found it: the operation is now succeeded."
    )
    expect(page.locator("#resolved")).to_contain_text("Resolved by ann at")
    expect(page.locator("#actions")).to_have_count(0)

    page.get_by_role("link", name="Find an operation").click()
    page.get_by_label("Search by").select_option("op_id")
    page.get_by_label("Tenant", exact=True).fill("acme")
    page.get_by_label("Value", exact=True).fill("op-1")
    page.get_by_role("button", name="Find").click()
    found = page.locator("#found")
    expect(found).to_contain_text("succeeded")
    shot(page, "find")
    found.get_by_role("link", name="op-1").click()
    expect(page.locator("#status")).to_contain_text("Done")
    audit = page.locator("#timeline li.tl-staff", has_text="ann")
    expect(audit).to_contain_text("ann looked it up and found it: succeeded")
    shot(page, "operation")

    page.get_by_role("link", name="Overview").click()
    expect(page.get_by_role("heading", level=1)).to_be_visible()
    expect(page.locator("svg").first).to_be_visible()
    shot(page, "overview")
    assert rig.op(op).state == "succeeded"


def test_from_the_queue_one_search_tells_two_partial_refunds_on_an_order_apart(
    rig: Rig, console: str, browser: Browser
) -> None:
    """ "Was the refund for order A1042 paid?": type the order id in the header's box and press
    Enter (one action); both partial refunds show with their amounts and the report's words."""
    paid = rig.enqueue("op-paid", {**GOOD, "amount_minor": 10000})
    rig.executor().execute([paid])
    rig.control.add_rule("commit_then_reset", times=1)  # done downstream, the answer lost
    unsure = rig.enqueue("op-unsure", {**GOOD, "amount_minor": 5000})
    rig.executor().execute([unsure])
    assert (rig.op(paid).state, rig.op(unsure).state) == ("succeeded", "unknown")
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann")  # on the review queue
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "Content Security" in m.text else None)

    page.get_by_role("searchbox", name=re.compile("^Find by order id")).fill("A1042")
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{console}/console/find?q=A1042")
    found = page.locator("#results tbody tr")
    expect(found).to_have_count(2)
    unsure_row, paid_row = found.nth(0), found.nth(1)  # newest first
    expect(unsure_row.locator(".answer strong")).to_have_text("Uncertain")
    expect(unsure_row.locator(".amount")).to_have_text("50.00 CNY")
    expect(paid_row.locator(".answer")).to_contain_text("Done")
    expect(paid_row.locator(".amount")).to_have_text("100.00 CNY")
    for row in (unsure_row, paid_row):
        expect(row).to_contain_text("P-7")
        expect(row).to_contain_text("A1042")
        expect(row.locator(".age time")).to_have_text(re.compile(r"^(just now|\d+ s ago)$"))
    shot(page, "search")
    assert blocked == []
    paid_row.get_by_role("link", name="op-paid").click()
    expect(page.locator("#status")).to_contain_text("Done")
    page.context.close()


def test_the_item_page_reads_as_a_sentence_a_timeline_and_local_times(
    rig: Rig, console: str, browser: Browser
) -> None:
    """The lead sentence, five reconcile passes folded into one line, a relative time whose
    title is the exact time in the viewer's own zone (times.js), and the raw evidence only
    once "Details" is opened."""
    op, item = stuck(rig, "op-5")
    for _ in range(5):  # five more passes, the lookup down each time: nothing new
        rig.make_due(op)
        rig.control.add_rule("lookup_unavailable", times=1)
        rig.reconciler().run_once()
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann", zone="Asia/Shanghai")
    page.goto(f"{console}/console/review/{item}")
    expect(page.locator("#lead")).to_have_text(
        "Refund of 100.00 CNY to payee P-7 for order A1042: the payment service's answer is "
        "unknown (the lookup was unavailable); look it up again now, or ask a supervisor."
    )
    folded = page.locator('#timeline li[data-count="5"]')
    expect(folded).to_contain_text("looked it up 5 times, nothing new")
    expect(page.locator("#timeline > li")).to_have_count(5)  # created, sent, lost, review, 5
    sent = page.locator("#timeline li.tl-sent time")
    expect(sent).to_have_text(re.compile(r"^(just now|\d+ (s|min) ago)$"))
    at = datetime.strptime(sent.get_attribute("datetime") or "", "%Y-%m-%dT%H:%M:%SZ")
    local = (at + timedelta(hours=8)).strftime("%H:%M:%S")  # Shanghai: UTC+8, no DST
    expect(sent).to_have_attribute("title", re.compile(rf"\b{local}\b.*(GMT\+8|CST)"))
    evidence = page.locator("#evidence")
    expect(evidence).to_be_hidden()  # raw JSON only behind the toggle
    page.locator("details", has=evidence).locator("summary").click()
    expect(evidence).to_be_visible()
    expect(evidence).to_contain_text('"lookup": "unavailable"')
    shot(page, "item-timeline")
    page.context.close()


def test_two_supervisors_resolve_at_once_the_second_is_told_who_won(
    rig: Rig, console: str, browser: Browser
) -> None:
    op, item = stuck(rig, "op-2")
    reference = rig.downstream_reference(op)
    add_staff(rig, "bob", "supervisor")
    add_staff(rig, "ada", "admin")
    pages = [signed_in(browser, console, name) for name in ("bob", "ada")]
    for page in pages:  # both open the item and fill the form before either sends it
        page.goto(f"{console}/console/review/{item}")
        form = page.locator('form.resolve[data-outcome="succeeded"]')
        form.get_by_label("Downstream reference").fill(reference)
        form.get_by_label("Justification").fill("checked with the provider's dashboard")
    bob, ada = pages
    bob.locator('form.resolve[data-outcome="succeeded"]').get_by_role("button").click()
    expect(bob.get_by_role("status")).to_have_text("Resolved: the operation is now succeeded.")
    ada.locator('form.resolve[data-outcome="succeeded"]').get_by_role("button").click()
    expect(ada.get_by_role("status")).to_contain_text("Already resolved by bob at")
    expect(ada.locator("#resolved")).to_contain_text("Resolved by bob")

    bob.goto(f"{console}/console/operations/acme/op-2")
    expect(bob.locator("#status")).to_contain_text("Done")
    resolved = bob.locator("#timeline li.tl-staff", has_text="bob")
    expect(resolved).to_contain_text("bob resolved it as succeeded")
    assert rig.op(op).state == "succeeded"


def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(
    rig: Rig, console: str, browser: Browser
) -> None:
    op, item = stuck(rig, "op-3")
    add_staff(rig, "vera", "viewer")
    page = signed_in(browser, console, "vera")
    page.goto(f"{console}/console/review/{item}")
    expect(page.get_by_role("heading", name=f"Review item #{item}")).to_be_visible()
    expect(page.get_by_role("button", name="Look it up again now")).to_have_count(0)
    expect(page.locator("form.resolve")).to_have_count(0)
    token = page.locator('form[action="/console/logout"] input[name="csrf_token"]')
    csrf = token.get_attribute("value")
    assert csrf
    forged = page.request.post(
        f"{console}/console/review/{item}/requery", form={"csrf_token": csrf}
    )
    assert forged.status == 403
    resolve: dict[str, str | float | bool] = {
        "csrf_token": csrf, "outcome": "rejected", "version": "1", "override": "true",
        "justification": "never reached the provider",
    }  # fmt: skip
    assert page.request.post(f"{console}/console/review/{item}/resolve", form=resolve).status == 403
    assert rig.op(op).state == "unknown"
    assert rig.reviews(op)[0].resolved_at is None


def test_support_approves_what_an_agent_proposed_and_sees_the_operation(
    rig: Rig, console: str, browser: Browser
) -> None:
    first = rig.enqueue("op-first")  # an earlier refund on the order, already paid
    rig.executor().execute([first])
    handles: list[str] = []

    async def model(client: Any) -> None:  # a client without elicitation: it waits for staff
        got = await call(client, "request_refund", **{**REFUND, "amount_minor": 5000})
        assert got["error"]["kind"] == "pending"
        handles.append(got["error"]["handle"])

    with ThreadPoolExecutor(1) as other:  # Playwright's sync API runs an event loop here
        other.submit(converse, server(rig), model).result(timeout=60)
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann")

    page.get_by_role("link", name="Agent proposals").click()
    row = page.locator("#proposals > tbody > tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("50.00 CNY")
    expect(row).to_contain_text("op-first")  # the earlier refund, on the list already
    shot(page, "proposals")
    row.get_by_role("link", name=re.compile(r"^#\d+$")).click()
    expect(page.locator("#not-first")).to_contain_text("already has 1 operation(s)")
    expect(page.locator("#on-order")).to_contain_text("100.00 CNY")
    shot(page, "proposal")
    page.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("status")).to_contain_text("Approved: operation op_")
    expect(page.locator("#decided")).to_contain_text("Approved by ann at")

    page.locator("#decided a").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("of acme")
    with rig.sessions() as s:
        (op,) = s.scalars(select(Operation).where(Operation.op_id != "op-first"))
    expect(page.get_by_role("heading", level=1)).to_contain_text(op.op_id)
    rig.executor().execute([op.id])
    page.reload()
    expect(page.locator("#status")).to_contain_text("Done")
    assert rig.control.refunded("acme", "A1042") == 15000  # the first, and the approved second


def test_another_origin_cannot_frame_the_sign_in_form(browser: Browser, console: str) -> None:
    """``frame-ancestors 'none'`` and ``X-Frame-Options: DENY``: the browser refuses to show
    the console inside a page from anywhere else (no clickjacking of the sign-in form)."""
    page = browser.new_context(viewport=VIEWPORT).new_page()
    with page.expect_console_message(lambda m: "frame-ancestors" in m.text) as refused:
        page.set_content(f'<iframe src="{console}/console/login" width="600" height="400">')
    assert "'none'" in refused.value.text
    (framed,) = [f for f in page.frames if f is not page.main_frame]
    assert framed.locator("input[name=password]").count() == 0
    page.context.close()


def test_the_pages_work_under_their_content_security_policy(
    rig: Rig, browser: Browser, console: str
) -> None:
    """Every main page, reached through htmx's boosted links, with no inline script or style
    the policy would block (a blocked one is reported on the browser's console)."""
    stuck(rig, "op-1")
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann")
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "Content Security" in m.text else None)
    page.get_by_role("link", name=re.compile(r"^#?\d+$")).first.click()
    expect(page.locator("#actions")).to_be_visible()
    for link, heading in [
        ("Find an operation", "Find"),
        ("Overview", "Overview"),
        ("Agent proposals", "Proposals"),
        ("Review queue", "Review"),
    ]:
        page.get_by_role("link", name=link).click()
        expect(page.locator("h1")).to_contain_text(heading)
    expect(page.locator("#chart")).to_have_count(0)  # the queue again: the chart page is gone
    assert blocked == []
    page.context.close()


def test_the_queue_shows_a_new_item_without_a_reload(
    rig: Rig, live_console: str, browser: Browser
) -> None:
    """The list polls its fragment: an item put in review after the page opened appears in
    it, while the page (and what is typed in its filter form) stays as it was."""
    add_staff(rig, "ann", "support")
    page = signed_in(browser, live_console, "ann")
    expect(page.locator("#queue-list")).to_contain_text("No open review items match.")
    page.evaluate("window.settledNotReloaded = true")  # gone if the page were loaded again
    page.get_by_label("Kind").fill("refu")  # half typed, never sent
    op, item = stuck(rig, "op-live")
    row = page.locator(f'#queue tr[data-item="{item}"]')
    expect(row).to_be_visible(timeout=20_000)
    expect(row.locator("a.operation")).to_have_text("op-live")
    expect(page.get_by_label("Kind")).to_have_value("refu")
    assert page.evaluate("window.settledNotReloaded") is True
    assert page.url == f"{live_console}/console/review"
    shot(page, "queue-live")
    page.context.close()
    assert rig.op(op).state == "unknown"


def test_a_half_typed_note_survives_the_items_refresh(
    rig: Rig, live_console: str, browser: Browser
) -> None:
    """The item's status polls on its own; the resolve form is outside it: a note being
    typed is still there after the status changed under it (someone else settled it)."""
    op, item = stuck(rig, "op-note")
    add_staff(rig, "bob", "supervisor")
    page = signed_in(browser, live_console, "bob")
    page.goto(f"{live_console}/console/review/{item}")
    expect(page.locator("#item-state")).to_have_attribute("data-resolved", "false")
    note = page.locator('form.resolve[data-outcome="succeeded"]').get_by_label("Justification")
    note.fill("checked with the provider's dash")  # half typed
    page.evaluate("window.settledNotReloaded = true")
    ReviewQueue(rig.sessions, rig.gateway(), rig.outbox.registry).requery(
        Staff.parse("ada", "admin"), item
    )  # another member of staff settles it meanwhile
    expect(page.locator("#item-state")).to_contain_text("Resolved by ada", timeout=20_000)
    expect(page.locator("#item-state")).to_have_attribute("data-resolved", "true")
    expect(note).to_have_value("checked with the provider's dash")
    expect(page.locator("#actions")).to_be_visible()  # a reload would show no form any more
    assert page.evaluate("window.settledNotReloaded") is True
    shot(page, "item-live")
    page.context.close()
    assert rig.op(op).state == "succeeded"


def test_a_mismatch_item_shows_the_found_record_and_resolves_with_it(
    rig: Rig, console: str, browser: Browser
) -> None:
    """The receipt did not match the request; the lookup found the executed refund. The page
    shows the record's reference (the one support is asked to type, already filled in), offers
    only "succeeded", and every answer on the way carries the security headers."""
    rig.control.add_rule("mismatched_receipt", times=1)
    op = rig.enqueue("op-mm")
    rig.executor().execute([op])
    rig.make_due(op)
    rig.reconciler().run_once()
    (item,) = rig.reviews(op)
    reference = rig.downstream_reference(op)
    add_staff(rig, "ann", "support")
    page = signed_in(browser, console, "ann")
    answers: list[Any] = []
    page.on("response", lambda r: answers.append(r) if "/console/" in r.url else None)
    page.goto(f"{console}/console/review/{item.id}")
    expect(page.locator("#found-record")).to_contain_text(reference)
    forms = page.locator("form.resolve")
    expect(forms).to_have_count(1)
    expect(forms).to_have_attribute("data-outcome", "succeeded")
    expect(forms.get_by_label("Downstream reference")).to_have_value(reference)
    shot(page, "item-mismatch")
    forms.get_by_label("Justification").fill("the lookup shows the refund was executed")
    forms.get_by_role("button").click()
    expect(page.get_by_role("status")).to_have_text("Resolved: the operation is now succeeded.")
    assert rig.op(op).state == "succeeded" and rig.op(op).downstream_ref == reference
    assert answers
    for answer in answers:
        headers = answer.all_headers()
        assert "frame-ancestors 'none'" in headers["content-security-policy"], answer.url
        assert headers["x-frame-options"] == "DENY", answer.url
        if answer.request.resource_type == "document":
            assert headers["cache-control"] == "no-store", answer.url
    page.context.close()
