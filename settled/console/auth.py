"""Staff sign-in for the console: the sign-in page, sign-out, and the two dependencies every
console page uses.

``current_user`` is the FastAPI dependency of every console page: the signed-in member of
staff, or, without a live session, a 303 to the sign-in page (an htmx request: 401 with an
``HX-Redirect`` header, so htmx loads the sign-in page instead of swapping it into a
fragment); ``polled_user`` is the same for the parts a page polls by itself, without marking
the session seen. ``require_csrf`` is the dependency of every form POST: it refuses (403) a request
whose CSRF token (form field ``csrf_token``, or header ``X-CSRF-Token`` for htmx requests) is
not the session's. The sign-in form has a token of its own (double-submit: a random value in
a cookie and in the form), since no session exists yet.

The session cookie ``settled_console`` is HttpOnly, ``Path=/console``, ``Secure`` when the
request came over TLS (uvicorn's ``--proxy-headers`` behind a proxy) or
``SETTLED_CONSOLE_SECURE_COOKIES`` forces it, and ``SameSite=Lax``: a link to an item pasted
into a ticket or a chat opens signed in (with ``Strict`` it would ask to sign in again),
while a cross-site POST still carries no cookie, and every POST needs the CSRF token anyway.
The rules (accounts, sessions, throttling) are ``support.accounts`` and
``support.signin``; this module is the HTTP around them. Its settings come from
``configure(app, settings)``, or the defaults.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Form, HTTPException, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session, sessionmaker

from settled.console.text import translate
from support.signin import (
    Refused,
    SignInPolicy,
    Throttled,
    csrf_token_for,
    session_staff,
    sign_in,
    sign_out,
    tokens_match,
)
from support.staff import Staff

COOKIE = "settled_console"
LOGIN_COOKIE = "settled_console_login"
LOGIN_PATH = "/console/login"
HOME = "/console/"
#: longer than any token we make: anything longer is not ours and is not looked up
TOKEN_MAX = 100
CSRF_REFUSED = (
    "This form has expired or did not come from the console: reload the page and try again."
)
WRONG = "Wrong name or password."

router = APIRouter()
templates = Jinja2Templates(directory=Path(__file__).with_name("templates"))


@dataclass(frozen=True)
class ConsoleUser:
    """A signed-in member of staff, and the CSRF token of their session."""

    staff: Staff
    csrf_token: str


def configure(app: FastAPI, settings: Any) -> None:
    """Take the sign-in settings (``SETTLED_CONSOLE_*``) for ``app``'s console."""
    app.state.console_policy = SignInPolicy.from_settings(settings)
    app.state.console_secure_cookies = bool(settings.console_secure_cookies)


def safe_next(value: str | None) -> str:
    """``value`` if it is a console path on this site, else the console's home: a sign-in
    never redirects to another site (``//evil``, ``https://evil``, ``/\\evil``)."""
    if not value or len(value) > 2000 or not value.isprintable() or "\\" in value:
        return HOME
    parts = urlsplit(value)
    path = parts.path
    if parts.scheme or parts.netloc or not (path == "/console" or path.startswith("/console/")):
        return HOME
    if ".." in path.split("/") or path.startswith(LOGIN_PATH):
        return HOME
    return value


def current_user(request: Request) -> ConsoleUser:
    """The signed-in member of staff (their session now seen), or a redirect to sign in."""
    return _user(request, seen=True)


def polled_user(request: Request) -> ConsoleUser:
    """``current_user`` for what a page polls by itself: the session is not marked seen, so
    an open tab does not keep it alive past its idle timeout."""
    return _user(request, seen=False)


def _user(request: Request, *, seen: bool) -> ConsoleUser:
    token = _session_token(request)
    staff = None
    if token is not None:
        with _sessions(request)() as s, s.begin():
            staff = session_staff(s, token, policy=_policy(request), seen=seen)
    if token is None or staff is None:
        raise _sign_in_required(request)
    request.state.staff = staff.id
    return ConsoleUser(staff, csrf_token_for(token))


async def require_csrf(request: Request) -> None:
    """Refuses (403) a form POST without the session's CSRF token."""
    presented: object = request.headers.get("X-CSRF-Token")
    if presented is None:
        presented = (await request.form()).get("csrf_token")
    token = _session_token(request)
    if token is None or not tokens_match(csrf_token_for(token), presented):
        raise HTTPException(status_code=403, detail=CSRF_REFUSED)


User = Annotated[ConsoleUser, Depends(current_user)]


@router.get("/console/login", include_in_schema=False)
def login_page(request: Request, next: str | None = None) -> Response:
    """The sign-in form; a member already signed in goes on to the page asked for."""
    token = _session_token(request)
    if token is not None:
        with _sessions(request)() as s, s.begin():
            if session_staff(s, token, policy=_policy(request)) is not None:
                return RedirectResponse(safe_next(next), status_code=303)
    return _login_form(request, next, status=200)


@router.post("/console/login", include_in_schema=False)
def login(
    request: Request,
    name: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
    csrf_token: Annotated[str, Form()] = "",
    next_: Annotated[str, Form(alias="next")] = "",
) -> Response:
    """Sign in: the form's own token, the throttles, then the password."""
    expected = request.cookies.get(LOGIN_COOKIE)
    if not expected or not tokens_match(expected, csrf_token):
        return _login_form(request, next_, status=403, error=CSRF_REFUSED, name=name)
    if "\x00" in name or "\x00" in password:  # no staff name has one (PostgreSQL text cannot)
        return _login_form(request, next_, status=401, error=WRONG)
    address = request.client.host if request.client is not None else None
    with _sessions(request)() as s, s.begin():
        result = sign_in(s, name, password, address=address, policy=_policy(request))
    if isinstance(result, Throttled):
        return PlainTextResponse(
            f"Too many failed sign-ins. Try again in {result.retry_after} seconds.",
            status_code=429,
            headers={"Retry-After": str(result.retry_after)},
        )
    if isinstance(result, Refused):
        return _login_form(request, next_, status=401, error=WRONG, name=name)
    response = RedirectResponse(safe_next(next_), status_code=303)
    response.set_cookie(
        COOKIE,
        result.token,
        path="/console",
        httponly=True,
        samesite="lax",
        secure=_secure(request),
    )
    response.delete_cookie(LOGIN_COOKIE, path=LOGIN_PATH)
    return response


@router.post("/console/logout", include_in_schema=False, dependencies=[Depends(require_csrf)])
def logout(request: Request) -> Response:
    """Sign out: the session ends now, and the cookie goes."""
    token = _session_token(request)
    if token is not None:
        with _sessions(request)() as s, s.begin():
            staff = session_staff(s, token, policy=_policy(request))
            sign_out(s, token, staff)
    response = RedirectResponse(LOGIN_PATH, status_code=303)
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="lax")
    return response


def _login_form(
    request: Request, next_: str | None, *, status: int, error: str | None = None, name: str = ""
) -> Response:
    """The sign-in page with a fresh form token, in its cookie and in the form."""
    form_token = secrets.token_urlsafe(32)
    context = {
        "user": None,  # base.html: signed out, so no nav and no sign-out form
        "lang": "en",
        "t": partial(translate, "en"),
        "csrf_token": form_token,
        "next": safe_next(next_),
        "error": error,
        "name": name[:64],
    }
    response = templates.TemplateResponse(request, "login.html", context, status_code=status)
    response.set_cookie(
        LOGIN_COOKIE,
        form_token,
        max_age=3600,
        path=LOGIN_PATH,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )
    response.headers["Cache-Control"] = "no-store"
    return response


def _sign_in_required(request: Request) -> HTTPException:
    """303 to the sign-in page, coming back here after; htmx: 401 with ``HX-Redirect``."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.headers.get("HX-Request") == "true":
        current = urlsplit(request.headers.get("HX-Current-URL", ""))
        page = current.path + (f"?{current.query}" if current.query else "")
        target = f"{LOGIN_PATH}?next={quote(safe_next(page), safe='/')}"
        return HTTPException(401, "sign in again", headers={"HX-Redirect": target})
    target = f"{LOGIN_PATH}?next={quote(safe_next(here), safe='/')}"
    return HTTPException(303, "sign in", headers={"Location": target})


def _session_token(request: Request) -> str | None:
    token = request.cookies.get(COOKIE)
    return token if token and len(token) <= TOKEN_MAX else None


def _sessions(request: Request) -> sessionmaker[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    return sessions


def _policy(request: Request) -> SignInPolicy:
    policy = getattr(request.app.state, "console_policy", None)
    return policy if isinstance(policy, SignInPolicy) else SignInPolicy()


def _secure(request: Request) -> bool:
    forced = bool(getattr(request.app.state, "console_secure_cookies", False))
    return forced or request.url.scheme == "https"
