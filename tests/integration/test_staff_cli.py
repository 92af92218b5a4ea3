"""``settled staff`` on PostgreSQL and SQLite: accounts created with a prompted or piped
password (never an argument), listed without hashes, refused on bad input with nothing
written, disabled (their sessions end at once) and given a new password; and migration 0005
up and down."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

from outbox.db import make_engine, upgrade
from settled.cli import main
from support.accounts import check_credentials
from support.signin import SignedIn, SignInPolicy, session_staff, sign_in
from tests.support import services

PASSWORD = "a long enough secret"
STAFF_TABLES = ("staff_login_failures", "staff_sessions", "staff_accounts")


@pytest.fixture
def db(engine: Engine) -> Engine:
    """A migrated PostgreSQL or SQLite database (emptied after the test by ``pg``)."""
    return engine


def staff(db: Engine, *args: str, stdin: str | None = None) -> Result:
    env = {"SETTLED_DATABASE_URL": db.url.render_as_string(hide_password=False)}
    return CliRunner().invoke(main, ["staff", *args], input=stdin, env=env)


def listed(db: Engine) -> list[dict[str, Any]]:
    result = staff(db, "list", "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.output)
    return rows


def test_create_from_stdin_and_list_without_hashes(db: Engine) -> None:
    made = staff(
        db,
        *("create", "alice", "--role", "support", "--tenant", "acme", "--tenant", "globex"),
        "--password-stdin",
        stdin=PASSWORD + "\n",
    )
    assert made.exit_code == 0, made.output
    assert "created alice (support; tenants: acme, globex)" in made.output
    root_made = staff(db, "create", "root", "--role", "admin", "--password-stdin", stdin=PASSWORD)
    assert root_made.exit_code == 0, root_made.output
    (alice, root) = listed(db)
    assert (alice["name"], alice["role"], alice["tenants"]) == (
        "alice",
        "support",
        ["acme", "globex"],
    )
    assert (root["name"], root["role"], root["tenants"]) == ("root", "admin", None)
    assert alice["disabled_at"] is None
    text_list = staff(db, "list")
    assert "alice" in text_list.output and "all tenants" in text_list.output
    for output in (text_list.output, json.dumps(listed(db))):
        assert "argon2" not in output and PASSWORD not in output
    with Session(db) as s:
        account = check_credentials(s, "alice", PASSWORD)
        assert account is not None and account.password_hash.startswith("$argon2id$")


def test_create_asks_for_the_password_twice(db: Engine) -> None:
    mismatch = staff(
        db, "create", "bob", "--role", "viewer", stdin=f"{PASSWORD}\nanother one!!\n" * 3
    )
    assert mismatch.exit_code != 0
    assert listed(db) == []
    made = staff(db, "create", "bob", "--role", "viewer", stdin=f"{PASSWORD}\n{PASSWORD}\n")
    assert made.exit_code == 0, made.output
    assert PASSWORD not in made.output  # the prompt hides what is typed
    with Session(db) as s:
        assert check_credentials(s, "bob", PASSWORD) is not None


@pytest.mark.parametrize(
    ("args", "stdin", "says"),
    [
        (("create", "bad name!", "--role", "support"), PASSWORD, "[invalid_staff]"),
        (("create", "carol", "--role", "support"), "too short", "[invalid_password]"),
        (("create", "carol", "--role", "support", "--tenant", "Not A Tenant"), PASSWORD, "tenant"),
        (("create", "carol", "--role", "root"), PASSWORD, "'root' is not one of"),
        (("create", "carol", "--role", "support", "--password", PASSWORD), "", "--password"),
    ],
)
def test_bad_input_is_one_error_and_writes_nothing(
    db: Engine, args: tuple[str, ...], stdin: str, says: str
) -> None:
    extra = ("--password-stdin",) if "--password" not in args else ()
    result = staff(db, *args, *extra, stdin=stdin)
    assert result.exit_code in (1, 2)
    assert says in result.output
    assert PASSWORD not in result.output and "too short" not in result.output
    assert listed(db) == []


def test_a_name_is_taken_once(db: Engine) -> None:
    assert (
        staff(
            db, "create", "alice", "--role", "support", "--password-stdin", stdin=PASSWORD
        ).exit_code
        == 0
    )
    again = staff(db, "create", "alice", "--role", "admin", "--password-stdin", stdin=PASSWORD)
    assert again.exit_code == 1
    assert "[staff_exists]" in again.output
    assert [a["role"] for a in listed(db)] == ["support"]


def test_disable_refuses_sign_in_and_ends_open_sessions_at_once(db: Engine) -> None:
    staff(db, "create", "alice", "--role", "support", "--password-stdin", stdin=PASSWORD)
    policy = SignInPolicy()
    with Session(db) as s, s.begin():
        signed = sign_in(s, "alice", PASSWORD, address="10.0.0.1", policy=policy)
    assert isinstance(signed, SignedIn)
    result = staff(db, "disable", "alice")
    assert result.exit_code == 0, result.output
    with Session(db) as s, s.begin():
        assert session_staff(s, signed.token, policy=policy) is None
        assert check_credentials(s, "alice", PASSWORD) is None
    assert listed(db)[0]["disabled_at"] is not None
    missing = staff(db, "disable", "nobody")
    assert missing.exit_code == 1 and "[staff_not_found]" in missing.output


def test_a_new_password_replaces_the_old_and_ends_sessions(db: Engine) -> None:
    staff(db, "create", "alice", "--role", "support", "--password-stdin", stdin=PASSWORD)
    policy = SignInPolicy()
    with Session(db) as s, s.begin():
        signed = sign_in(s, "alice", PASSWORD, address=None, policy=policy)
    assert isinstance(signed, SignedIn)
    changed = staff(db, "password", "alice", "--password-stdin", stdin="a brand new passphrase\n")
    assert changed.exit_code == 0, changed.output
    with Session(db) as s, s.begin():
        assert session_staff(s, signed.token, policy=policy) is None
        assert check_credentials(s, "alice", PASSWORD) is None
        assert check_credentials(s, "alice", "a brand new passphrase") is not None
    assert staff(db, "password", "nobody", "--password-stdin", stdin=PASSWORD).exit_code == 1


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.sqlite3'}"
        return
    server = request.getfixturevalue("pg_server")
    with services.throwaway_database(server, f"settled_m_{uuid.uuid4().hex[:8]}") as url:
        yield url


def test_migration_0005_adds_the_staff_tables_and_takes_them_away(empty_url: str) -> None:
    upgrade(empty_url, "0005")
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            assert set(STAFF_TABLES) <= tables
            with pytest.raises(Exception, match=r"(?i)check|constraint"):
                conn.execute(
                    text(
                        "INSERT INTO staff_accounts (name, password_hash, role)"
                        " VALUES ('x', 'h', 'root')"
                    )
                )
        from alembic import command

        from outbox.db import alembic_config

        command.downgrade(alembic_config(empty_url), "0004")
        with engine.connect() as conn:
            assert not set(STAFF_TABLES) & set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
