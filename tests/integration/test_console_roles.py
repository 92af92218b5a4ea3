"""The support console over HTTP with its real sign-in (no dependency overrides): accounts made
by ``support.accounts``, signed in through ``POST /console/login`` with the token read from
the sign-in page, then every page and every action by each role, tenant limits, the CSRF token,
signing out and a disabled account's open session.

Items come from the simulator's faults (``in_review``) or are parked by hand (``parked``),
against real PostgreSQL."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session
from starlette.exceptions import StarletteDeprecationWarning

from outbox.kinds import default_registry
from outbox.models import OperationEvent
from settled.web import create_web_app
from support.accounts import create_account, disable_account
from support.review import ReviewQueue
from tests.integration.test_console_pages import items_listed, parked
from tests.integration.test_review import in_review
from tests.support.rig import Rig

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.postgres

PASSWORD = "a long enough password"
ACTING = ("support", "supervisor", "admin")
PAGES = ("/console/review", "/console/find", "/console/overview")


@pytest.fixture
def engine(pg: Engine) -> Engine:
    """PostgreSQL only, as the console's page tests."""
    return pg


@pytest.fixture
def client(rig: Rig) -> Iterator[TestClient]:
    queue = ReviewQueue(rig.sessions, rig.gateway(), default_registry(), lookup_timeout=2.0)
    app = create_web_app(rig.sessions, review=queue)
    with TestClient(app, follow_redirects=False) as c:
        yield c


def add_staff(rig: Rig, name: str, role: str, tenants: list[str] | None = None) -> None:
    with rig.sessions.begin() as s:
        create_account(s, name=name, password=PASSWORD, role=role, tenants=tenants)


def csrf_in(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None, page
    return found.group(1)


def sign_in(client: TestClient, name: str) -> str:
    """Sign in through the form; the CSRF token the console's pages then carry."""
    client.cookies.clear()
    form = client.get("/console/login")
    assert form.status_code == 200
    data = {"name": name, "password": PASSWORD, "csrf_token": csrf_in(form.text), "next": ""}
    signed = client.post("/console/login", data=data)
    assert (signed.status_code, signed.headers["location"]) == (303, "/console/")
    return csrf_in(client.get("/console/review").text)


def post(client: TestClient, path: str, csrf: str | None, **form: Any) -> Any:
    if csrf is not None:
        form["csrf_token"] = csrf
    return client.post(path, data=form)


def actors(rig: Rig) -> list[str | None]:
    with rig.sessions() as s:
        return list(s.scalars(select(OperationEvent.actor)))


def reasons_by(rig: Rig, actor: str) -> list[str | None]:
    """The reasons of the events ``actor`` wrote (a refusal is audited too)."""
    with rig.sessions() as s:
        query = select(OperationEvent.reason).where(OperationEvent.actor == actor)
        return list(s.scalars(query))


def test_the_sign_in_page_stands_alone_without_nav_or_sign_out(client: TestClient) -> None:
    page = client.get("/console/login").text
    assert 'action="/console/login"' in page and "<nav>" not in page
    assert "/console/logout" not in page and "/console/static/console.css" in page


@pytest.mark.parametrize("role", ["viewer", *ACTING])
def test_every_page_opens_for_every_role(rig: Rig, client: TestClient, role: str) -> None:
    _op, item = in_review(rig)
    add_staff(rig, "sam", role)
    sign_in(client, "sam")
    for path in (*PAGES, f"/console/review/{item}", "/console/operations/acme/op-1"):
        page = client.get(path)
        assert page.status_code == 200, (path, page.text)
        assert f"sam ({role})" in page.text
    assert "op-1" in client.get("/console/find", params={"key": "order_id", "value": "A1042"}).text
    item_page = client.get(f"/console/review/{item}").text
    assert ('id="actions"' in item_page) is (role != "viewer")


def test_a_viewer_sees_no_action_and_is_refused_both(rig: Rig, client: TestClient) -> None:
    op, item = in_review(rig)
    add_staff(rig, "vera", "viewer")
    csrf = sign_in(client, "vera")
    assert "/requery" not in client.get(f"/console/review/{item}").text
    assert post(client, f"/console/review/{item}/requery", csrf).status_code == 403
    form = {"outcome": "succeeded", "version": 1, "reference": "re_x", "override": "true",
            "justification": "checked with the provider"}  # fmt: skip
    assert post(client, f"/console/review/{item}/resolve", csrf, **form).status_code == 403
    assert rig.op(op).state == "unknown" and rig.reviews(op)[0].resolved_at is None
    assert reasons_by(rig, "staff:vera") == ["staff_refused", "staff_refused"]


@pytest.mark.parametrize("role", ACTING)
def test_acting_roles_requery_and_are_audited(rig: Rig, client: TestClient, role: str) -> None:
    op, item = in_review(rig)
    add_staff(rig, "sam", role)
    csrf = sign_in(client, "sam")
    r = post(client, f"/console/review/{item}/requery", csrf)
    assert r.status_code == 200
    assert "The lookup found it: the operation is now succeeded." in r.text
    assert rig.op(op).state == "succeeded"
    assert rig.reviews(op)[0].resolved_by == "staff:sam"
    assert "staff:sam" in actors(rig)


@pytest.mark.parametrize("role", ["supervisor", "admin"])
def test_overriding_roles_resolve_through_the_form(rig: Rig, client: TestClient, role: str) -> None:
    op, item = in_review(rig)
    add_staff(rig, "sam", role)
    csrf = sign_in(client, "sam")
    form = {"outcome": "succeeded", "version": 1, "reference": rig.downstream_reference(op),
            "override": "true", "justification": "checked with the provider"}  # fmt: skip
    r = post(client, f"/console/review/{item}/resolve", csrf, **form)
    assert r.status_code == 200 and "Resolved: the operation is now succeeded." in r.text
    assert rig.op(op).state == "succeeded"
    assert rig.reviews(op)[0].resolved_by == "staff:sam"


def test_support_may_not_override_the_evidence(rig: Rig, client: TestClient) -> None:
    op, item = in_review(rig)
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    assert 'class="resolve"' not in client.get(f"/console/review/{item}").text
    form = {"outcome": "succeeded", "version": 1, "reference": rig.downstream_reference(op),
            "override": "true", "justification": "checked with the provider"}  # fmt: skip
    r = post(client, f"/console/review/{item}/resolve", csrf, **form)
    assert r.status_code == 403 and "You may not do this." in r.text
    assert rig.op(op).state == "unknown"


def test_a_limited_member_sees_nothing_of_other_tenants(rig: Rig, client: TestClient) -> None:
    acme = parked(rig, "op-acme")
    globex = parked(rig, "op-glob", tenant="globex")
    add_staff(rig, "gil", "supervisor", ["globex"])
    csrf = sign_in(client, "gil")
    assert items_listed(client.get("/console/review").text) == [globex]
    assert client.get(f"/console/review/{acme}").status_code == 404
    assert client.get("/console/operations/acme/op-acme").status_code == 404
    assert client.get("/console/operations/globex/op-glob").status_code == 200
    found = client.get("/console/find", params={"key": "order_id", "value": "A1042"}).text
    assert "op-glob" in found and "op-acme" not in found
    assert post(client, f"/console/review/{acme}/requery", csrf).status_code == 404
    form = {"outcome": "rejected", "version": 1, "override": "true",
            "justification": "never reached the provider"}  # fmt: skip
    assert post(client, f"/console/review/{acme}/resolve", csrf, **form).status_code == 404
    assert "staff:gil" not in actors(rig)


def test_an_action_without_the_csrf_token_writes_nothing(rig: Rig, client: TestClient) -> None:
    op, item = in_review(rig)
    add_staff(rig, "bob", "supervisor")
    sign_in(client, "bob")
    assert post(client, f"/console/review/{item}/requery", None).status_code == 403
    assert post(client, f"/console/review/{item}/requery", "not-the-token").status_code == 403
    form = {"outcome": "succeeded", "version": 1, "reference": rig.downstream_reference(op),
            "override": "true", "justification": "checked with the provider"}  # fmt: skip
    assert post(client, f"/console/review/{item}/resolve", None, **form).status_code == 403
    assert rig.op(op).state == "unknown" and rig.reviews(op)[0].resolved_at is None
    assert "staff:bob" not in actors(rig)


def test_signed_out_every_page_goes_to_the_sign_in(rig: Rig, client: TestClient) -> None:
    _op, item = in_review(rig)
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    out = post(client, "/console/logout", csrf)
    assert (out.status_code, out.headers["location"]) == (303, "/console/login")
    for path in (*PAGES, f"/console/review/{item}"):
        page = client.get(path)
        assert page.status_code == 303
        assert page.headers["location"].startswith("/console/login?next=")
    refused = post(client, f"/console/review/{item}/requery", csrf)
    assert refused.status_code == 403  # the cookie is gone: its token no longer acts
    assert rig.reviews(_op)[0].resolved_at is None


def test_a_disabled_accounts_open_session_is_refused(rig: Rig, client: TestClient) -> None:
    op, item = in_review(rig)
    add_staff(rig, "ann", "support")
    csrf = sign_in(client, "ann")
    assert client.get("/console/review").status_code == 200
    with Session(rig.engine) as s, s.begin():
        disable_account(s, "ann")
    assert client.get("/console/review").status_code == 303
    assert post(client, f"/console/review/{item}/requery", csrf).status_code == 303
    assert rig.op(op).state == "unknown" and rig.reviews(op)[0].resolved_at is None
