"""Staff sign-in for the console. (Interface only; the implementation follows.)

``current_user`` is the FastAPI dependency of every console page: the signed-in member of
staff, or a redirect to the sign-in page. ``require_csrf`` is the dependency of every form
POST: it refuses a request whose CSRF token (form field ``csrf_token``, or header
``X-CSRF-Token`` for htmx requests) is not the session's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Request

from reconciler.staff import Staff

router = APIRouter()


@dataclass(frozen=True)
class ConsoleUser:
    """A signed-in member of staff, and the CSRF token of their session."""

    staff: Staff
    csrf_token: str


def current_user(request: Request) -> ConsoleUser:
    """The signed-in member of staff."""
    raise NotImplementedError


def require_csrf(request: Request) -> None:
    """Refuses a form POST without the session's CSRF token."""
    raise NotImplementedError
