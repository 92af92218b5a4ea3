"""Staff accounts of the support console, their sessions and failed sign-ins.

Only hashes are stored: an argon2id hash of each password, a SHA-256 hash of each session
token and of each throttling key (a name, a client address). Every time is the database's
(``db_now``), so every web process agrees on when a session or a throttle ends. The rules
(what a password must be, when to throttle) are ``support.accounts`` and
``support.signin``; nothing is committed here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Float, Table, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import StaffAccount, StaffLoginFailure, StaffSession

accounts: Table = StaffAccount.__table__  # type: ignore[assignment]
sessions: Table = StaffSession.__table__  # type: ignore[assignment]
failures: Table = StaffLoginFailure.__table__  # type: ignore[assignment]

_NOW = db_now()
_IDLE = db_now(bindparam("idle_ago", type_=Float()))
_WINDOW = db_now(bindparam("window_ago", type_=Float()))

ACCOUNT_COLUMNS = (
    accounts.c.id,
    accounts.c.name,
    accounts.c.password_hash,
    accounts.c.role,
    accounts.c.tenants,
    accounts.c.created_at,
    accounts.c.disabled_at,
)
ACCOUNT_BY_NAME = select(*ACCOUNT_COLUMNS).where(accounts.c.name == bindparam("name"))
ACCOUNT_BY_ID = select(*ACCOUNT_COLUMNS).where(accounts.c.id == bindparam("id"))
ALL_ACCOUNTS = select(*ACCOUNT_COLUMNS).order_by(accounts.c.name)
DISABLE = (
    update(accounts)
    .where(accounts.c.name == bindparam("a_name"), accounts.c.disabled_at.is_(None))
    .values(disabled_at=_NOW)
    .returning(accounts.c.id)
)
SET_HASH = (
    update(accounts)
    .where(accounts.c.id == bindparam("a_id"))
    .values(password_hash=bindparam("a_hash"))
)

START_SESSION = insert(sessions).values(
    account_id=bindparam("account_id"),
    token_hash=bindparam("token_hash"),
    created_at=_NOW,
    last_seen_at=_NOW,
    expires_at=db_now(bindparam("max_seconds", type_=Float())),
)
#: what makes a session live: not ended, not past its end, not idle too long, and its account
#: not disabled
_LIVE = (
    sessions.c.token_hash == bindparam("s_token_hash"),
    sessions.c.ended_at.is_(None),
    sessions.c.expires_at > _NOW,
    sessions.c.last_seen_at > _IDLE,
    sessions.c.account_id.in_(
        select(accounts.c.id).where(accounts.c.disabled_at.is_(None)).scalar_subquery()
    ),
)
#: a live session is seen now
TOUCH_SESSION = (
    update(sessions).where(*_LIVE).values(last_seen_at=_NOW).returning(sessions.c.account_id)
)
#: a live session's account, the session left as it was (a page polling is not its user)
PEEK_SESSION = select(sessions.c.account_id).where(*_LIVE)
END_SESSION = (
    update(sessions)
    .where(sessions.c.token_hash == bindparam("s_token_hash"), sessions.c.ended_at.is_(None))
    .values(ended_at=_NOW)
)
END_SESSIONS_OF = (
    update(sessions)
    .where(sessions.c.account_id == bindparam("s_account_id"), sessions.c.ended_at.is_(None))
    .values(ended_at=_NOW)
)

ADD_FAILURE = insert(failures).values(key_hash=bindparam("key_hash"), at=_NOW)
#: the newest failures of a key inside the window, newest first, and the database's time
RECENT_FAILURES = (
    select(failures.c.at, _NOW.label("now"))
    .where(failures.c.key_hash == bindparam("key_hash"), failures.c.at > _WINDOW)
    .order_by(failures.c.at.desc())
    .limit(bindparam("limit"))
)
DATABASE_TIME = select(_NOW)
CLEAR_FAILURES = delete(failures).where(failures.c.key_hash == bindparam("key_hash"))
FORGET_OLD_FAILURES = delete(failures).where(failures.c.at <= _WINDOW)


class StoredAccount(NamedTuple):
    id: int
    name: str
    password_hash: str
    role: str
    tenants: list[str] | None
    created_at: datetime
    disabled_at: datetime | None


def add_account(
    session: Session, *, name: str, password_hash: str, role: str, tenants: list[str] | None
) -> bool:
    """A new account row (flushed, not committed); False, with nothing written, if the name
    is taken (also by somebody else's transaction committed meanwhile)."""
    if account_by_name(session, name) is not None:
        return False
    try:
        with session.begin_nested():
            row = StaffAccount(name=name, password_hash=password_hash, role=role, tenants=tenants)
            session.add(row)
    except IntegrityError:
        return False
    return True


def account_by_name(session: Session, name: str) -> StoredAccount | None:
    row = session.execute(ACCOUNT_BY_NAME, {"name": name}).first()
    return StoredAccount(*row) if row is not None else None


def account_by_id(session: Session, account_id: int) -> StoredAccount | None:
    row = session.execute(ACCOUNT_BY_ID, {"id": account_id}).first()
    return StoredAccount(*row) if row is not None else None


def all_accounts(session: Session) -> list[StoredAccount]:
    return [StoredAccount(*row) for row in session.execute(ALL_ACCOUNTS)]


def disable_account(session: Session, name: str) -> bool:
    """Disable the enabled account ``name`` and end its sessions; False: no such enabled one."""
    account_id = session.execute(DISABLE, {"a_name": name}).scalar()
    if account_id is None:
        return False
    session.execute(END_SESSIONS_OF, {"s_account_id": account_id})
    return True


def set_password_hash(session: Session, account_id: int, password_hash: str) -> None:
    session.execute(SET_HASH, {"a_id": account_id, "a_hash": password_hash})


def start_session(
    session: Session, *, account_id: int, token_hash: str, max_seconds: float
) -> None:
    """A session that starts now and ends ``max_seconds`` later at the latest."""
    params = {"account_id": account_id, "token_hash": token_hash, "max_seconds": max_seconds}
    session.execute(START_SESSION, params)


def touch_session(session: Session, token_hash: str, *, idle_seconds: float) -> int | None:
    """The account id of the live session ``token_hash``, now seen; None: no live session."""
    params: dict[str, Any] = {"s_token_hash": token_hash, "idle_ago": -idle_seconds}
    return session.execute(TOUCH_SESSION, params).scalar()


def peek_session(session: Session, token_hash: str, *, idle_seconds: float) -> int | None:
    """The account id of the live session ``token_hash``, not marked seen; None: none."""
    params: dict[str, Any] = {"s_token_hash": token_hash, "idle_ago": -idle_seconds}
    return session.execute(PEEK_SESSION, params).scalar()


def end_session(session: Session, token_hash: str) -> None:
    session.execute(END_SESSION, {"s_token_hash": token_hash})


def end_sessions_of(session: Session, account_id: int) -> None:
    session.execute(END_SESSIONS_OF, {"s_account_id": account_id})


def add_failure(session: Session, key_hash: str, *, window_seconds: float) -> None:
    """Count a failure against ``key_hash``; failures past the window are forgotten."""
    session.execute(FORGET_OLD_FAILURES, {"window_ago": -window_seconds})
    session.execute(ADD_FAILURE, {"key_hash": key_hash})


def recent_failures(
    session: Session, key_hash: str, *, window_seconds: float, limit: int
) -> tuple[datetime, list[datetime]]:
    """The database's time, and the newest ``limit`` failures of ``key_hash`` inside the
    window (newest first)."""
    params: dict[str, Any] = {
        "key_hash": key_hash,
        "window_ago": -window_seconds,
        "limit": limit,
    }
    rows = session.execute(RECENT_FAILURES, params).all()
    now = rows[0].now if rows else session.execute(DATABASE_TIME).scalar_one()
    return now, [row.at for row in rows]


def clear_failures(session: Session, key_hash: str) -> None:
    session.execute(CLEAR_FAILURES, {"key_hash": key_hash})
