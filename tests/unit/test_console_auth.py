"""The console's sign-in rules that need no database: where a sign-in may send you back to,
when a throttle lifts, the CSRF token of a session, and what an account name, password and
tenant list must be."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.errors import InvalidIdentifier, InvalidInput
from outbox.storage.staff_accounts import StoredAccount
from settled.console.auth import HOME, safe_next
from support.accounts import (
    MAX_PASSWORD,
    MIN_PASSWORD,
    check_name,
    check_password,
    check_role,
    check_tenants,
    staff_of,
)
from support.signin import (
    csrf_token_for,
    throttle_key,
    token_hash,
    tokens_match,
    wait_before_retry,
)
from support.staff import Role

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=15)


@pytest.mark.parametrize(
    "asked",
    [
        "/console/",
        "/console",
        "/console/items/12",
        "/console/items?tenant=acme&page=2",
        "/console/find?q=a%2Fb",
    ],
)
def test_a_console_path_is_where_sign_in_returns(asked: str) -> None:
    assert safe_next(asked) == asked


@pytest.mark.parametrize(
    "asked",
    [
        None,
        "",
        "https://evil.example/console/",
        "//evil.example/console/",
        "///evil.example",
        "/\\evil.example",
        "\\\\evil.example",
        "http:/console/x",
        "javascript:alert(1)",
        "/v1/runs/abc",
        "/consolex/items",
        "/console/../v1/runs",
        "/console/login?next=//evil",
        "/console/\r\nSet-Cookie: x=1",
        "console/items",
        "/console/" + "a" * 3000,
    ],
)
def test_anything_else_returns_to_the_console_home(asked: str | None) -> None:
    assert safe_next(asked) == HOME


def test_no_throttle_below_the_limit() -> None:
    recent = [NOW - timedelta(minutes=m) for m in (1, 2)]
    assert wait_before_retry(NOW, recent, limit=3, window=WINDOW) is None


def test_throttle_lifts_when_the_limit_th_newest_failure_leaves_the_window() -> None:
    # newest first: 1, 5, 10 minutes ago; with a limit of 3, the third newest (10 min ago)
    # leaves the 15-minute window in 5 minutes, and then only two are left
    recent = [NOW - timedelta(minutes=m) for m in (1, 5, 10)]
    assert wait_before_retry(NOW, recent, limit=3, window=WINDOW) == 300
    # with a limit of 2 the second newest decides: it leaves in 10 minutes
    assert wait_before_retry(NOW, recent, limit=2, window=WINDOW) == 600


def test_a_throttle_about_to_lift_still_asks_for_a_second() -> None:
    recent = [NOW - WINDOW + timedelta(milliseconds=10)]
    assert wait_before_retry(NOW, recent, limit=1, window=WINDOW) == 1


def test_the_csrf_token_is_the_sessions_own() -> None:
    a, b = csrf_token_for("token-a" * 5), csrf_token_for("token-b" * 5)
    assert a == csrf_token_for("token-a" * 5)
    assert a != b
    assert "token-a" not in a
    assert tokens_match(a, a)
    assert not tokens_match(a, b)
    assert not tokens_match(a, None)
    assert not tokens_match(a, "")
    assert not tokens_match(a, a + "x")
    assert not tokens_match(a, "é" * len(a))  # not ASCII: refused, not an error


def test_what_the_database_keeps_is_a_hash_never_the_value() -> None:
    token = "s3cr3t-session-token"
    assert token not in token_hash(token)
    assert len(token_hash(token)) == 64
    assert throttle_key("name", "alice") != throttle_key("address", "alice")
    assert "alice" not in throttle_key("name", "alice")


@pytest.mark.parametrize("name", ["alice", "a", "bob.smith@example.com", "x_1-2"])
def test_staff_names_follow_the_staff_id_rule(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-alice", "al ice", "a" * 65, "ali\x00ce", "名前", None])
def test_a_bad_staff_name_is_refused(name: object) -> None:
    with pytest.raises(InvalidInput) as err:
        check_name(name)
    assert err.value.code == "invalid_staff"


@pytest.mark.parametrize(
    "password", ["x" * (MIN_PASSWORD - 1), "x" * (MAX_PASSWORD + 1), "long enough\x00pw", None]
)
def test_a_bad_password_is_refused_without_quoting_it(password: object) -> None:
    with pytest.raises(InvalidInput) as err:
        check_password(password)
    assert err.value.code == "invalid_password"
    if isinstance(password, str):
        assert password not in err.value.message


def test_a_password_of_the_allowed_lengths_is_taken() -> None:
    for length in (MIN_PASSWORD, MAX_PASSWORD):
        assert check_password("p" * length) == "p" * length


def test_roles_and_tenants_are_checked() -> None:
    assert check_role("admin") is Role.ADMIN
    with pytest.raises(InvalidInput):
        check_role("root")
    assert check_tenants(None) is None
    assert check_tenants([]) is None
    assert check_tenants(["globex", "acme", "acme"]) == ["acme", "globex"]
    with pytest.raises(InvalidIdentifier):
        check_tenants(["Acme Corp"])


def test_an_account_signs_in_as_its_role_and_tenants() -> None:
    limited = StoredAccount(1, "alice", "h", "support", ["acme"], NOW, None)
    everyone = StoredAccount(2, "bob", "h", "viewer", None, NOW, None)
    alice, bob = staff_of(limited), staff_of(everyone)
    assert (alice.id, alice.role, alice.tenants) == ("alice", Role.SUPPORT, frozenset({"acme"}))
    assert alice.sees("acme") and not alice.sees("globex")
    assert bob.tenants is None and bob.sees("globex")
