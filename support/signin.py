"""Signing staff in to the console: sessions, their CSRF tokens, and sign-in throttling.

A session is a random token (``secrets.token_urlsafe(32)``) that only the staff member's
cookie holds; the database keeps its SHA-256 hash, when it started, when it was last used and
when it ends at the latest. It ends after ``idle`` without a request, ``max_age`` after
sign-in, at sign-out, or when its account is disabled or its password changed. Its CSRF token
is derived from the session token (an HMAC keyed by it), so it is random per session, needs no
storage, and cannot be computed by anyone who does not hold the cookie.

Throttling: every failed sign-in counts against the name tried and against the client's
address (both stored as hashes). Once either has ``max_failures`` (a name) or
``max_failures_per_address`` (an address) failures inside ``window``, sign-in is refused for
it until the oldest of them leaves the window; refused attempts do not count, so a throttle
always lifts. A success clears its own name's count, nothing else. Times are the database's,
so every web process agrees. Sign-ins, failures (the name tried, never the password) and
sign-outs go to the ``settled.audit`` log; nothing is committed here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from outbox.storage import staff_accounts as store
from support.accounts import check_credentials, staff_of
from support.staff import Staff

audit = logging.getLogger("settled.audit")


@dataclass(frozen=True)
class SignInPolicy:
    """How long sessions last and when sign-in is throttled (``SETTLED_CONSOLE_*``)."""

    idle: timedelta = timedelta(minutes=30)
    max_age: timedelta = timedelta(hours=12)
    max_failures: int = 5
    max_failures_per_address: int = 20
    window: timedelta = timedelta(minutes=15)

    @classmethod
    def from_settings(cls, settings: Any) -> SignInPolicy:
        return cls(
            idle=timedelta(minutes=settings.console_session_idle_minutes),
            max_age=timedelta(hours=settings.console_session_max_hours),
            max_failures=settings.console_login_max_failures,
            max_failures_per_address=settings.console_login_max_failures_per_address,
            window=timedelta(minutes=settings.console_login_window_minutes),
        )


@dataclass(frozen=True)
class SignedIn:
    staff: Staff
    #: the session token: for the cookie only, never logged or stored
    token: str


@dataclass(frozen=True)
class Refused:
    """Wrong name or password (or a disabled account): one answer for all of them."""


@dataclass(frozen=True)
class Throttled:
    #: whole seconds until the next attempt may be made
    retry_after: int


SignInResult = SignedIn | Refused | Throttled


def token_hash(token: str) -> str:
    """What the database keeps of a session token."""
    return hashlib.sha256(token.encode()).hexdigest()


def csrf_token_for(session_token: str) -> str:
    """The CSRF token of the session whose token is ``session_token``."""
    mac = hmac.new(session_token.encode(), b"settled-console-csrf", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def tokens_match(expected: str, presented: object) -> bool:
    """Whether ``presented`` is ``expected``, compared in constant time."""
    if not isinstance(presented, str) or not presented.isascii():
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


def throttle_key(kind: str, value: str) -> str:
    """What the database keeps of a throttled name or address (a name tried may be a
    password typed in the wrong field: never stored as typed)."""
    return hashlib.sha256(f"{kind}\x00{value}".encode()).hexdigest()


def wait_before_retry(
    now: datetime, recent: Sequence[datetime], *, limit: int, window: timedelta
) -> int | None:
    """Seconds until fewer than ``limit`` failures are left in the window (``recent``: the
    newest failures inside it, newest first); None when fewer already are."""
    if len(recent) < limit:
        return None
    frees_at = recent[limit - 1] + window  # then only limit - 1 are left inside it
    return max(1, math.ceil((frees_at - now).total_seconds()))


def sign_in(
    session: Session, name: str, password: str, *, address: str | None, policy: SignInPolicy
) -> SignInResult:
    """Check the throttles, then the password; a new session for the right one."""
    keys = {throttle_key("name", name): policy.max_failures}
    if address:
        keys[throttle_key("address", address)] = policy.max_failures_per_address
    window = policy.window.total_seconds()
    waits = []
    for key, limit in keys.items():
        now, recent = store.recent_failures(session, key, window_seconds=window, limit=limit)
        waits.append(wait_before_retry(now, recent, limit=limit, window=policy.window))
    wait = max((w for w in waits if w is not None), default=None)
    if wait is not None:
        audit.warning("console sign-in throttled", extra={"staff": name[:64]})
        return Throttled(wait)
    account = check_credentials(session, name, password)
    if account is None:
        for key in keys:
            store.add_failure(session, key, window_seconds=window)
        audit.warning("console sign-in failed", extra={"staff": name[:64]})
        return Refused()
    store.clear_failures(session, throttle_key("name", name))
    token = secrets.token_urlsafe(32)
    store.start_session(
        session,
        account_id=account.id,
        token_hash=token_hash(token),
        max_seconds=policy.max_age.total_seconds(),
    )
    staff = staff_of(account)
    audit.info("console sign-in", extra={"staff": staff.id, "role": staff.role.value})
    return SignedIn(staff, token)


def session_staff(
    session: Session, token: str, *, policy: SignInPolicy, seen: bool = True
) -> Staff | None:
    """The member of staff of the live session ``token`` (now seen, unless not ``seen``: a
    page polling keeps no session alive); None: none is live."""
    idle = policy.idle.total_seconds()
    read = store.touch_session if seen else store.peek_session
    account_id = read(session, token_hash(token), idle_seconds=idle)
    account = store.account_by_id(session, account_id) if account_id is not None else None
    return staff_of(account) if account is not None else None


def sign_out(session: Session, token: str, staff: Staff | None) -> None:
    """End the session ``token`` (if it is still live, its member is ``staff``)."""
    store.end_session(session, token_hash(token))
    if staff is not None:
        audit.info("console sign-out", extra={"staff": staff.id})
