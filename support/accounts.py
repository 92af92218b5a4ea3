"""Staff accounts: who may sign in to the console, with what role and which tenants.

One set of rules for ``settled staff`` and the console: a name is a staff id
(``support.staff.STAFF_ID``), a role one of ``Role``, tenants well-formed tenant names
(none given: every tenant), a password 12 to 1024 characters. Passwords are kept only as
argon2id hashes (argon2-cffi's defaults, RFC 9106's second recommended set); checking one
takes the same work whether the name exists or not (a dummy hash stands in), so the answer's
time does not tell which names exist. Nothing is committed here: the caller owns the
transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy.orm import Session

from outbox.errors import InvalidInput, NotFound
from outbox.ids import validate_tenant
from outbox.storage import staff_accounts as store
from support.staff import STAFF_ID, Role, Staff

MIN_PASSWORD = 12
#: long passphrases are welcome; beyond this a request only makes the server hash for long
MAX_PASSWORD = 1024

HASHER = PasswordHasher()


@dataclass(frozen=True)
class Account:
    """An account as ``settled staff list`` shows it (never its hash)."""

    name: str
    role: str
    tenants: tuple[str, ...] | None
    created_at: datetime
    disabled_at: datetime | None


def check_name(name: object) -> str:
    """``name`` if it is a valid staff id, else InvalidInput."""
    if not isinstance(name, str) or STAFF_ID.fullmatch(name) is None:
        raise InvalidInput(
            "a staff name is 1-64 characters: letters, digits and . _ @ - (not first)",
            code="invalid_staff",
            field="name",
        )
    return name


def check_password(password: object) -> str:
    """``password`` if it is long enough and not too long, else InvalidInput (never quoted)."""
    if not isinstance(password, str) or not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise InvalidInput(
            f"a password is {MIN_PASSWORD} to {MAX_PASSWORD} characters",
            code="invalid_password",
            field="password",
        )
    if "\x00" in password:
        raise InvalidInput("a password cannot contain NUL", code="invalid_password")
    return password


def check_role(role: object) -> Role:
    try:
        return Role(str(role))
    except ValueError:
        raise InvalidInput(
            f"role must be one of {[r.value for r in Role]}", code="invalid_role", field="role"
        ) from None


def check_tenants(tenants: Iterable[str] | None) -> list[str] | None:
    """The tenants, sorted and each checked; None or empty: every tenant."""
    if not tenants:
        return None
    return sorted({validate_tenant(t) for t in tenants})


def create_account(
    session: Session,
    *,
    name: str,
    password: str,
    role: str,
    tenants: Iterable[str] | None = None,
) -> Account:
    """A new account (flushed, not committed); InvalidInput if anything is wrong or the name
    is taken, with nothing written."""
    name, password = check_name(name), check_password(password)
    checked_role, checked_tenants = check_role(role), check_tenants(tenants)
    added = store.add_account(
        session,
        name=name,
        password_hash=HASHER.hash(password),
        role=checked_role.value,
        tenants=checked_tenants,
    )
    if not added:
        raise InvalidInput(f"a staff account {name!r} exists already", code="staff_exists")
    account = store.account_by_name(session, name)
    assert account is not None
    return _shown(account)


def disable_account(session: Session, name: str) -> None:
    """Disable ``name`` and end its sessions at once; NotFound if no such enabled account."""
    if not store.disable_account(session, check_name(name)):
        raise NotFound("no such enabled staff account", code="staff_not_found")


def change_password(session: Session, name: str, password: str) -> None:
    """Set a new password and end the account's sessions (whoever held one signs in again)."""
    password = check_password(password)
    account = store.account_by_name(session, check_name(name))
    if account is None:
        raise NotFound("no such staff account", code="staff_not_found")
    store.set_password_hash(session, account.id, HASHER.hash(password))
    store.end_sessions_of(session, account.id)


def list_accounts(session: Session) -> list[Account]:
    return [_shown(a) for a in store.all_accounts(session)]


def check_credentials(session: Session, name: str, password: str) -> store.StoredAccount | None:
    """The enabled account ``name`` if ``password`` is its password, else None.

    Unknown, disabled and malformed names cost one argon2 verification too (against a dummy
    hash), so the time of the answer is the same for all of them.
    """
    well_formed = isinstance(name, str) and STAFF_ID.fullmatch(name) is not None
    account = store.account_by_name(session, name) if well_formed else None
    usable = account is not None and account.disabled_at is None and len(password) <= MAX_PASSWORD
    stored = account.password_hash if account is not None and usable else _dummy_hash()
    ok = _verify(stored, password[:MAX_PASSWORD])
    if account is None or not usable or not ok:
        return None
    if HASHER.check_needs_rehash(account.password_hash):  # the parameters were raised
        store.set_password_hash(session, account.id, HASHER.hash(password))
    return account


def staff_of(account: store.StoredAccount) -> Staff:
    """The member of staff an account signs in as: its role and its tenants (None: all)."""
    tenants = frozenset(account.tenants) if account.tenants is not None else None
    return Staff(account.name, Role(account.role), tenants)


def _verify(stored: str, password: str) -> bool:
    try:
        return HASHER.verify(stored, password)
    except (VerificationError, InvalidHashError):
        return False


@functools.cache
def _dummy_hash() -> str:
    """A hash of nothing anyone knows, made with the same parameters as real ones."""
    return HASHER.hash("settled: no such staff account")


def _shown(account: store.StoredAccount) -> Account:
    tenants = tuple(account.tenants) if account.tenants is not None else None
    return Account(account.name, account.role, tenants, account.created_at, account.disabled_at)
