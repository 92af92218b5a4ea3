"""Console sign-in over HTTP against real PostgreSQL: sessions, their expiry, the cookie's
flags, CSRF, throttling, disabled accounts, no open redirect and no secret in the logs.

The app is the console's router and two pages of this test's own (one page, one form POST);
time moves by moving the stored times back, never by sleeping.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI, Form
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import StarletteDeprecationWarning

from outbox.settings import Settings
from settled.console.auth import (
    COOKIE,
    CSRF_REFUSED,
    WRONG,
    ConsoleUser,
    User,
    configure,
    polled_user,
    require_csrf,
    router,
)
from support import accounts
from support.accounts import create_account, disable_account

with warnings.catch_warnings():
    # as in test_web: Starlette's TestClient would rather run on httpx2; on httpx it works
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.postgres

PASSWORD = "correct horse battery"


@pytest.fixture
def db(pg: Engine) -> Engine:
    """The session's PostgreSQL database, its tables (the staff ones too) emptied after."""
    return pg


def make_app(engine: Engine, **settings: Any) -> FastAPI:
    """The console's sign-in, a page that needs a member of staff and a form that needs CSRF."""
    app = FastAPI()
    app.state.sessions = sessionmaker(engine, expire_on_commit=False)
    policy = {"console_login_max_failures": 3, "console_login_max_failures_per_address": 6}
    configure(app, Settings(**{**policy, **settings}))
    app.include_router(router)

    @app.get("/console/whoami")
    def whoami(user: User) -> dict[str, Any]:
        tenants = sorted(user.staff.tenants) if user.staff.tenants is not None else None
        return {"staff": user.staff.id, "role": user.staff.role.value, "tenants": tenants}

    @app.get("/console/polled")
    def polled(user: Annotated[ConsoleUser, Depends(polled_user)]) -> dict[str, str]:
        return {"staff": user.staff.id}  # as the queue's and an item's polled fragments

    @app.post("/console/act", dependencies=[Depends(require_csrf)])
    def act(user: User, note: Annotated[str, Form()] = "") -> dict[str, str]:
        return {"by": user.staff.id, "note": note}

    return app


def client_of(app: FastAPI, *, address: str = "10.0.0.1", https: bool = False) -> TestClient:
    base = "https://console.test" if https else "http://console.test"
    return TestClient(app, base_url=base, follow_redirects=False, client=(address, 40000))


@pytest.fixture
def app(db: Engine) -> FastAPI:
    return make_app(db)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with client_of(app) as c:
        yield c


def add_staff(engine: Engine, name: str, role: str = "support", tenants: Any = None) -> None:
    with Session(engine) as s, s.begin():
        create_account(s, name=name, password=PASSWORD, role=role, tenants=tenants)


def form_token(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None, page
    return found.group(1)


def sign_in(client: TestClient, name: str, password: str = PASSWORD, next_: str = "") -> Any:
    client.cookies.clear()  # a fresh browser: signed in as nobody
    page = client.get("/console/login")
    assert page.status_code == 200
    data = {"name": name, "password": password, "csrf_token": form_token(page.text)}
    return client.post("/console/login", data={**data, "next": next_})


def csrf_of(client: TestClient) -> str:
    """The CSRF token the console gives this client's session (as a page would carry it)."""
    from support.signin import csrf_token_for

    return csrf_token_for(client.cookies[COOKIE])


def move_back(engine: Engine, table: str, column: str, interval: str) -> None:
    """Move every stored ``column`` of ``table`` back by ``interval``: time passes."""
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE {table} SET {column} = {column} - CAST(:i AS interval)"),
            {"i": interval},
        )


def test_sign_in_reach_a_page_and_sign_out(db: Engine, client: TestClient) -> None:
    add_staff(db, "alice", "support", ["acme"])
    first = client.get("/console/whoami")
    assert first.status_code == 303
    assert first.headers["location"] == "/console/login?next=/console/whoami"

    signed = sign_in(client, "alice", next_="/console/whoami")
    assert signed.status_code == 303
    assert signed.headers["location"] == "/console/whoami"
    me = client.get("/console/whoami")
    assert me.json() == {"staff": "alice", "role": "support", "tenants": ["acme"]}
    # signed in already: the sign-in page sends you on
    again = client.get("/console/login", params={"next": "/console/items/3"})
    assert (again.status_code, again.headers["location"]) == (303, "/console/items/3")

    token = client.cookies[COOKIE]
    out = client.post("/console/logout", data={"csrf_token": csrf_of(client)})
    assert (out.status_code, out.headers["location"]) == (303, "/console/login")
    assert client.get("/console/whoami").status_code == 303
    # the session ended on the server: the old cookie, replayed, is refused too
    client.cookies.set(COOKIE, token, path="/console")
    assert client.get("/console/whoami").status_code == 303


def test_wrong_password_and_unknown_name_answer_the_same(
    db: Engine, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_staff(db, "alice")
    verified: list[str] = []
    real_verify = accounts._verify
    monkeypatch.setattr(accounts, "_verify", lambda h, p: verified.append(h) or real_verify(h, p))
    wrong = sign_in(client, "alice", "not the password!")
    unknown = sign_in(client, "mallory", PASSWORD)
    for answer in (wrong, unknown):
        assert answer.status_code == 401
        assert WRONG in answer.text
        assert COOKIE not in answer.cookies
    assert form_token(wrong.text) != form_token(unknown.text)
    strip = re.compile(r'value="[^"]*"')
    assert strip.sub("", wrong.text) == strip.sub("", unknown.text.replace("mallory", "alice"))
    # both cost one argon2 verification: the unknown name against a dummy hash
    assert len(verified) == 2
    assert all(h.startswith("$argon2id$") for h in verified)


def test_a_name_is_throttled_after_its_failures_and_freed_after_the_window(
    db: Engine, client: TestClient
) -> None:
    add_staff(db, "alice")
    add_staff(db, "bob")
    for _ in range(3):
        assert sign_in(client, "alice", "wrong password!!").status_code == 401
    refused = sign_in(client, "alice")  # the right password, but too late
    assert refused.status_code == 429
    assert refused.headers["content-type"].startswith("text/plain")
    assert 840 <= int(refused.headers["retry-after"]) <= 900
    assert "Too many failed sign-ins" in refused.text
    assert COOKIE not in refused.cookies
    assert sign_in(client, "bob").status_code == 303  # another name is not throttled

    move_back(db, "staff_login_failures", "at", "16 minutes")
    assert sign_in(client, "alice").status_code == 303


def test_an_address_is_throttled_whatever_names_it_tries(app: FastAPI, db: Engine) -> None:
    add_staff(db, "alice")
    with client_of(app, address="10.0.0.9") as guesser:
        for n in range(6):
            assert sign_in(guesser, f"guess{n}", "wrong password!!").status_code == 401
        assert sign_in(guesser, "alice").status_code == 429
    with client_of(app, address="10.0.0.10") as colleague:
        assert sign_in(colleague, "alice").status_code == 303


def test_a_success_resets_only_its_own_names_count(app: FastAPI, db: Engine) -> None:
    add_staff(db, "alice")
    add_staff(db, "bob")
    # two desks, so that only the names' counts are at stake (not an address's)
    with client_of(app, address="10.0.0.1") as a, client_of(app, address="10.0.0.2") as b:
        for _ in range(2):
            sign_in(a, "alice", "wrong password!!")
            sign_in(b, "bob", "wrong password!!")
        assert sign_in(b, "bob").status_code == 303  # bob's count starts again
        assert sign_in(a, "alice", "wrong password!!").status_code == 401  # alice's third
        assert sign_in(a, "alice").status_code == 429
        for _ in range(2):
            assert sign_in(b, "bob", "wrong password!!").status_code == 401
        assert sign_in(b, "bob").status_code == 303


def test_a_disabled_account_cannot_sign_in_and_its_session_ends(
    db: Engine, client: TestClient
) -> None:
    add_staff(db, "alice")
    assert sign_in(client, "alice").status_code == 303
    assert client.get("/console/whoami").status_code == 200
    with Session(db) as s, s.begin():
        disable_account(s, "alice")
    assert client.get("/console/whoami").status_code == 303
    refused = sign_in(client, "alice")
    assert refused.status_code == 401 and WRONG in refused.text


def test_a_session_ends_after_the_idle_timeout_and_is_kept_alive_by_use(
    db: Engine, client: TestClient
) -> None:
    add_staff(db, "alice")
    sign_in(client, "alice")
    move_back(db, "staff_sessions", "last_seen_at", "29 minutes")
    assert client.get("/console/whoami").status_code == 200  # used: seen now
    move_back(db, "staff_sessions", "last_seen_at", "29 minutes")
    assert client.get("/console/whoami").status_code == 200
    move_back(db, "staff_sessions", "last_seen_at", "31 minutes")
    assert client.get("/console/whoami").status_code == 303


def test_a_page_polling_by_itself_keeps_no_session_alive(db: Engine, client: TestClient) -> None:
    """The queue and an item poll their fragments (``polled_user``): that is not the member of
    staff using it, so the idle timeout still ends a session left open in a tab."""
    add_staff(db, "alice")
    sign_in(client, "alice")
    poll = {"HX-Request": "true", "HX-Current-URL": "http://testserver/console/review"}
    move_back(db, "staff_sessions", "last_seen_at", "29 minutes")
    assert client.get("/console/polled", headers=poll).status_code == 200  # still live
    move_back(db, "staff_sessions", "last_seen_at", "2 minutes")  # 31 min since last use
    r = client.get("/console/polled", headers=poll)
    assert r.status_code == 401 and r.headers["hx-redirect"].startswith("/console/login")
    assert client.get("/console/whoami").status_code == 303


def test_a_session_ends_at_its_absolute_lifetime_however_busy(
    db: Engine, client: TestClient
) -> None:
    add_staff(db, "alice")
    sign_in(client, "alice")
    with db.connect() as conn:
        lifetime = conn.execute(text("SELECT expires_at - created_at FROM staff_sessions"))
        # (two readings of the database's clock in one statement: microseconds apart)
        assert lifetime.scalar_one().total_seconds() == pytest.approx(12 * 3600, abs=1)
    move_back(db, "staff_sessions", "expires_at", "12 hours")  # started 12 h ago
    assert client.get("/console/whoami").status_code == 303


def cookie_header(response: Any, name: str) -> str:
    (header,) = [h for h in response.headers.get_list("set-cookie") if h.startswith(name + "=")]
    return header.lower()


def test_the_session_cookie_flags(app: FastAPI, db: Engine) -> None:
    add_staff(db, "alice")
    with client_of(app) as plain:
        page = plain.get("/console/login")
        form_cookie = cookie_header(page, "settled_console_login")
        assert "httponly" in form_cookie and "samesite=strict" in form_cookie
        assert "path=/console/login" in form_cookie
        session_cookie = cookie_header(sign_in(plain, "alice"), COOKIE)
    assert "httponly" in session_cookie
    assert "samesite=lax" in session_cookie
    assert "path=/console;" in session_cookie or session_cookie.endswith("path=/console")
    assert "secure" not in session_cookie  # plain http: a Secure cookie would be dropped
    with client_of(app, https=True) as tls:
        assert "secure" in cookie_header(sign_in(tls, "alice"), COOKIE)
    # behind a TLS proxy uvicorn does not trust: the request looks like plain http
    forced = make_app(db, console_secure_cookies=True)
    with client_of(forced) as behind_proxy:
        page = behind_proxy.get("/console/login")
        assert "secure" in cookie_header(page, "settled_console_login")
        token = form_token(page.text)
        signed = behind_proxy.post(
            "/console/login",
            data={"name": "alice", "password": PASSWORD, "csrf_token": token},
            headers={"Cookie": f"settled_console_login={token}"},  # as the browser sends it
        )
        assert "secure" in cookie_header(signed, COOKIE)


def test_a_form_post_needs_the_sessions_csrf_token(
    app: FastAPI, db: Engine, client: TestClient
) -> None:
    add_staff(db, "alice")
    add_staff(db, "bob")
    sign_in(client, "alice")
    with client_of(app) as other:
        sign_in(other, "bob")
        bobs = csrf_of(other)
    for data in ({"note": "x"}, {"note": "x", "csrf_token": "forged"}, {"csrf_token": bobs}):
        refused = client.post("/console/act", data=data)
        assert refused.status_code == 403
        assert CSRF_REFUSED in refused.text
    by_form = client.post("/console/act", data={"note": "hi", "csrf_token": csrf_of(client)})
    assert by_form.json() == {"by": "alice", "note": "hi"}
    by_header = client.post("/console/act", headers={"X-CSRF-Token": csrf_of(client)})
    assert by_header.json() == {"by": "alice", "note": ""}
    assert client.post("/console/logout").status_code == 403  # sign-out is a form too


def test_the_sign_in_form_needs_its_own_token(db: Engine, client: TestClient) -> None:
    add_staff(db, "alice")
    page = client.get("/console/login")
    good = {"name": "alice", "password": PASSWORD}
    forged = client.post("/console/login", data={**good, "csrf_token": "forged"})
    assert forged.status_code == 403 and CSRF_REFUSED in forged.text
    client.cookies.clear()  # a cross-site form: the right field, but no cookie
    no_cookie = client.post("/console/login", data={**good, "csrf_token": form_token(page.text)})
    assert no_cookie.status_code == 403
    assert COOKIE not in client.cookies
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM staff_sessions")).scalar_one() == 0


@pytest.mark.parametrize(
    "asked", ["https://evil.example/", "//evil.example/console/", "/\\evil.example", "/v1/x"]
)
def test_sign_in_never_redirects_off_the_console(
    db: Engine, client: TestClient, asked: str
) -> None:
    add_staff(db, "alice")
    answer = sign_in(client, "alice", next_=asked)
    assert (answer.status_code, answer.headers["location"]) == (303, "/console/")


def test_an_htmx_request_without_a_session_is_told_where_to_sign_in(client: TestClient) -> None:
    headers = {"HX-Request": "true", "HX-Current-URL": "http://console.test/console/items?p=2"}
    answer = client.get("/console/whoami", headers=headers)
    assert answer.status_code == 401
    assert answer.headers["hx-redirect"] == "/console/login?next=/console/items%3Fp%3D2"


def test_sign_ins_are_audited_without_a_password_or_token(
    db: Engine, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    add_staff(db, "alice")
    caplog.set_level(logging.DEBUG)
    sign_in(client, "alice", "the wrong password")
    sign_in(client, "alice")
    token, csrf = client.cookies[COOKIE], csrf_of(client)
    client.post("/console/act", data={"csrf_token": csrf})
    client.post("/console/logout", data={"csrf_token": csrf})
    audit = [(r.getMessage(), getattr(r, "staff", None)) for r in caplog.records]
    audit = [a for a in audit if a[0].startswith("console sign")]
    assert audit == [
        ("console sign-in failed", "alice"),
        ("console sign-in", "alice"),
        ("console sign-out", "alice"),
    ]
    everything = " ".join(f"{r.getMessage()} {r.__dict__!r}" for r in caplog.records)
    for secret in ("the wrong password", PASSWORD, token, csrf):
        assert secret not in everything
