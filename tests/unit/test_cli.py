"""The ``settled`` command line on bad input: one ``Error: ...`` line on stderr, a non-zero exit
status, no traceback, nothing written, no secret echoed. And the restored ``apikey`` commands.

Runs in process through click's CliRunner against an SQLite file (no servers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.apikeys import authenticate
from outbox.db import make_engine, upgrade
from outbox.models import ApiKey
from settled.cli import main

STAFF = ["--staff", "alice", "--role", "support"]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture
def cli(db_url: str) -> CliRunner:
    # Only this test's configuration: no SETTLED_ variable of the calling shell.
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SETTLED_")}
    env["SETTLED_DATABASE_URL"] = db_url
    return CliRunner(env=env)


def api_keys(db_url: str) -> int:
    engine = make_engine(db_url)
    try:
        with Session(engine) as s:
            return s.scalar(select(func.count()).select_from(ApiKey)) or 0
    finally:
        engine.dispose()


def settled(cli: CliRunner, args: list[str], env: dict[str, str] | None = None) -> Result:
    return cli.invoke(main, args, prog_name="settled", env=env)


def assert_one_line_error(result: Result, status: int | None = None) -> str:
    """The command failed with exactly one ``Error:`` line on stderr and no traceback."""
    assert result.exit_code != 0, result.output
    if status is not None:
        assert result.exit_code == status, result.stderr
    # An exception other than SystemExit escaping the command is a traceback for the user.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


BAD_INPUT = {
    "item id beyond bigint": ["review", "show", "99999999999999999999", *STAFF],
    "negative item id": ["review", "requery", "-1", *STAFF],
    "item id not a number": ["review", "show", "12abc", *STAFF],
    "version beyond integer": [
        "review", "resolve", "1", "--as", "rejected", "--version", "99999999999",
        "--justification", "no record", *STAFF,
    ],
    "justification not UTF-8": [
        "review", "resolve", "1", "--as", "rejected", "--version", "1",
        "--justification", "\udcff\udcfe", *STAFF,
    ],
    "reference not UTF-8": [
        "review", "resolve", "1", "--as", "succeeded", "--version", "1",
        "--reference", "re_\udcff", *STAFF,
    ],
    "tenant filter not UTF-8": ["review", "list", "--tenant", "ac\udcffme", *STAFF],
    "reason filter with NUL": ["review", "list", "--reason", "a\x00b", *STAFF],
    "staff id not UTF-8": ["review", "list", "--staff", "al\udcffice", "--role", "support"],
    "staff id not allowed": ["review", "list", "--staff", "alice smith", "--role", "support"],
    "unknown role": ["review", "list", "--staff", "alice", "--role", "root"],
    "older-than NaN": ["review", "list", "--older-than", "nan", *STAFF],
    "older-than infinite": ["review", "list", "--older-than", "inf", *STAFF],
    "older-than beyond timedelta": ["review", "list", "--older-than", "1e300", *STAFF],
    "older-than negative": ["review", "list", "--older-than", "-5", *STAFF],
    "missing staff": ["review", "list"],
    "unknown review item": ["review", "show", "12", *STAFF],
    "apikey tenant not UTF-8": ["apikey", "create", "--tenant", "ac\udcffme"],
    "apikey tenant not allowed": ["apikey", "create", "--tenant", "acme corp!"],
    "apikey revoke unknown": ["apikey", "revoke", "0123456789abcdef"],
    "apikey revoke not UTF-8": ["apikey", "revoke", "\udcff"],
    "web port out of range": ["web", "--port", "70000"],
    "run port out of range": ["run", "--web-port", "0"],
    "worker concurrency zero": ["worker", "--concurrency", "0"],
    "worker unknown pool": ["worker", "--pool", "gevent-ish"],
    "worker unknown log level": ["worker", "--loglevel", "LOUD"],
    "beat unknown log level": ["beat", "--loglevel", "LOUD"],
    "simulator port negative": ["simulator", "--port", "-1"],
    "simulator tenant without key": ["simulator", "--tenant", "acme"],
    "simulator tenant not UTF-8": ["simulator", "--tenant", "ac\udcffme=sk_1"],
    "unknown command": ["nosuch"],
    "unknown subcommand": ["apikey", "rotate"],
    "unknown option": ["--bogus"],
}  # fmt: skip


@pytest.mark.parametrize("args", list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_is_one_line_and_a_non_zero_exit(
    cli: CliRunner, db_url: str, args: list[str]
) -> None:
    result = settled(cli, args)
    assert_one_line_error(result)
    assert api_keys(db_url) == 0  # nothing written


def test_usage_errors_exit_2_and_refusals_exit_1(cli: CliRunner) -> None:
    line = assert_one_line_error(settled(cli, BAD_INPUT["item id beyond bigint"]), 2)
    assert "settled review show" in line and "ITEM" in line
    line = assert_one_line_error(settled(cli, BAD_INPUT["unknown review item"]), 1)
    assert line == "Error: [review_item_not_found] no such review item"


def test_staff_id_from_the_environment_is_checked_too(cli: CliRunner) -> None:
    result = settled(
        cli,
        ["review", "list"],
        env={"SETTLED_STAFF_ID": "al\udcff", "SETTLED_STAFF_ROLE": "viewer"},
    )
    assert "--staff" in assert_one_line_error(result, 2)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SETTLED_MAX_ATTEMPTS", "sk_live_not_a_number"),
        ("SETTLED_DOWNSTREAM_API_KEYS", '{"acme": ["sk_live_not_a_string"]}'),
        ("SETTLED_DOWNSTREAM_API_KEYS", "sk_live_not_json"),
    ],
)
def test_bad_configuration_is_one_line_naming_the_variable_not_its_value(
    cli: CliRunner, variable: str, value: str
) -> None:
    result = settled(cli, ["review", "list", *STAFF], env={variable: value})
    line = assert_one_line_error(result, 1)
    assert "configuration" in line
    assert variable.removeprefix("SETTLED_").lower() in line.lower()
    assert "sk_live" not in result.output


def test_unreachable_database_is_one_line_without_the_password(cli: CliRunner) -> None:
    url = "postgresql+psycopg://settled:pw_s3cret@127.0.0.1:9/settled?connect_timeout=2"
    result = settled(
        cli, ["apikey", "create", "--tenant", "acme"], env={"SETTLED_DATABASE_URL": url}
    )
    line = assert_one_line_error(result, 1)
    assert line.startswith("Error: database error")
    assert "pw_s3cret" not in result.output


def test_unparsable_database_url_is_one_line_without_the_url(cli: CliRunner) -> None:
    result = settled(cli, ["review", "list", *STAFF], env={"SETTLED_DATABASE_URL": "pw_s3cret://"})
    assert assert_one_line_error(result, 1) == "Error: invalid database URL"
    assert "pw_s3cret" not in result.output


def test_apikey_create_prints_a_working_key_once_and_revoke_disables_it(
    cli: CliRunner, db_url: str
) -> None:
    created = settled(cli, ["apikey", "create", "--tenant", "acme"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip()
    (id_line,) = created.stderr.splitlines()
    key_id = id_line.removeprefix("key id: ")
    assert key.startswith(f"stk_{key_id}_")
    engine = make_engine(db_url)
    try:
        with Session(engine) as s:
            principal = authenticate(s, key)
            assert principal is not None and principal.tenant == "acme"
            assert key.split("_")[-1] not in str(s.scalars(select(ApiKey.secret_hash)).all())

        revoked = settled(cli, ["apikey", "revoke", key_id])
        assert revoked.exit_code == 0, revoked.output
        assert revoked.stdout.strip() == "revoked"
        with Session(engine) as s:
            assert authenticate(s, key) is None
    finally:
        engine.dispose()
    again = settled(cli, ["apikey", "revoke", key_id])
    assert assert_one_line_error(again, 1) == "Error: [api_key_not_found] no such active key"


def test_no_arguments_prints_the_help_listing_every_command(cli: CliRunner) -> None:
    result = settled(cli, [])
    for command in ("apikey", "beat", "db", "demo", "review", "run", "web", "worker"):
        assert f"  {command} " in result.output


# -- start-up: one clear line, before anything runs ------------------------------------------

#: Values of the operator's own (not the development ones).
OWN = {
    "SETTLED_FINGERPRINT_KEYS": '{"v1": "an-operators-own-key-0001"}',
    "SETTLED_IDEMPOTENCY_SECRET": "an-operators-own-secret-01",
}
NOBODY_PG = "postgresql+psycopg://settled:pw-never-echoed@127.0.0.1:1/settled"
STARTS = [["worker"], ["beat"], ["web"]]


@pytest.mark.parametrize("command", STARTS, ids=lambda c: c[0])
def test_start_refuses_the_development_secrets_against_postgresql(
    cli: CliRunner, command: list[str]
) -> None:
    result = settled(cli, command, env={"SETTLED_DATABASE_URL": NOBODY_PG})
    line = assert_one_line_error(result, 1)
    assert "SETTLED_FINGERPRINT_KEYS and SETTLED_IDEMPOTENCY_SECRET" in line
    assert "ready" not in result.output


def test_development_mode_allows_them_and_goes_on_to_check_the_database(cli: CliRunner) -> None:
    env = {"SETTLED_DATABASE_URL": NOBODY_PG, "SETTLED_DEVELOPMENT": "1"}
    line = assert_one_line_error(settled(cli, ["worker"], env=env), 1)
    assert "database error" in line and "development" not in line


@pytest.mark.parametrize("command", STARTS, ids=lambda c: c[0])
def test_start_against_a_database_that_does_not_answer_is_one_line(
    cli: CliRunner, command: list[str]
) -> None:
    result = settled(cli, command, env={**OWN, "SETTLED_DATABASE_URL": NOBODY_PG})
    line = assert_one_line_error(result, 1)
    assert "database error" in line
    assert "pw-never-echoed" not in result.output


@pytest.mark.parametrize("command", STARTS, ids=lambda c: c[0])
def test_start_against_a_database_never_migrated_says_to_upgrade(
    cli: CliRunner, command: list[str], tmp_path: Path
) -> None:
    env = {"SETTLED_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.sqlite3'}"}
    line = assert_one_line_error(settled(cli, command, env=env), 1)
    assert "run `settled db upgrade`" in line


@pytest.mark.parametrize("command", [["worker"], ["beat"]], ids=lambda c: c[0])
def test_start_against_a_broker_that_does_not_answer_is_one_line(
    cli: CliRunner, command: list[str]
) -> None:
    env = {"SETTLED_BROKER_URL": "redis://:broker-pw-never-echoed@127.0.0.1:1/0"}
    result = settled(cli, command, env=env)
    line = assert_one_line_error(result, 1)
    assert "cannot reach the broker at redis://" in line and "SETTLED_BROKER_URL" in line
    assert "broker-pw-never-echoed" not in result.output


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("SETTLED_FINGERPRINT_KEYS", '{"v1": "too-short"}', "SETTLED_FINGERPRINT_KEYS"),
        ("SETTLED_FINGERPRINT_KEY_VERSION", "v7", "SETTLED_FINGERPRINT_KEY_VERSION"),
        ("SETTLED_MAX_ATTEMPTS", "-3", "SETTLED_MAX_ATTEMPTS"),
        ("SETTLED_DOWNSTREAM_CONTRACTS", '{"refnud": {}}', "SETTLED_DOWNSTREAM_CONTRACTS"),
        ("SETTLED_DOWNSTREAM_CONTRACTS", '{"refund": {"idempotant": false}}', "idempotant"),
    ],
)
@pytest.mark.parametrize("command", STARTS, ids=lambda c: c[0])
def test_start_with_a_misconfiguration_is_one_line_naming_it(
    cli: CliRunner, command: list[str], variable: str, value: str, named: str
) -> None:
    result = settled(cli, command, env={variable: value})
    line = assert_one_line_error(result, 1)
    assert named in line
    assert "too-short" not in result.output


def test_review_list_on_a_database_never_migrated_says_to_upgrade(
    cli: CliRunner, tmp_path: Path
) -> None:
    env = {"SETTLED_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.sqlite3'}"}
    line = assert_one_line_error(settled(cli, ["review", "list", *STAFF], env=env), 1)
    assert "run `settled db upgrade`" in line


def test_version_names_the_installed_distribution_and_the_schema_head(cli: CliRunner) -> None:
    from importlib.metadata import version

    from outbox.db import schema_heads

    (head,) = schema_heads("sqlite://")
    result = settled(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"settled, version {version('settled')}, schema head {head}"


@pytest.mark.parametrize(("flag", "fence"), [([], True), (["--no-deadline-fence"], False)])
def test_the_simulator_command_turns_the_deadline_fence_off_only_when_told(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, flag: list[str], fence: bool
) -> None:
    started: dict[str, object] = {}
    monkeypatch.setattr("settled.simulator.run", lambda **kw: started.update(kw))
    result = settled(cli, ["simulator", "--tenant", "acme=sk_1", *flag])
    assert result.exit_code == 0, result.output
    assert started["deadline_fence"] is fence
