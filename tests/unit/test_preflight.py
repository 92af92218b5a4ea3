"""The preflight every start shares (``settled.preflight``), and what reading the settings
refuses before it: each misconfiguration is one ``Error:`` line and a non-zero exit, on every
command that fingerprints, approves, sends or serves, before anything is created, written or
sent. In process (click's CliRunner) against SQLite files; ``tests/integration/
test_preflight.py`` runs the real commands against PostgreSQL and Redis."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from outbox.db import schema_heads, upgrade
from outbox.errors import InvalidSetting
from outbox.intake import Outbox
from outbox.settings import OTHER_VARIABLES, Settings, masked, unknown_variables
from settled.cli import main

ROOT = Path(__file__).parents[2]
(HEAD,) = schema_heads("sqlite://")

#: Every command that fingerprints, approves, sends or serves.
STARTS = {
    "worker": ["worker"],
    "beat": ["beat"],
    "web": ["web"],
    "run": ["run"],
    "mcp stdio": ["mcp"],
    "mcp http": ["mcp", "--transport", "http"],
    "review": ["review", "list", "--staff", "alice", "--role", "viewer"],
    "proposals": ["proposals", "list"],
    "reconcile": ["reconcile", "--once"],
    "check": ["check"],
}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder: the default database ``./settled.sqlite3`` would land here."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    upgrade(url)
    return url


def run(args: list[str], env: dict[str, str]) -> Result:
    """``settled ARGS`` with only ``env`` of SETTLED_ variables (none of the calling shell)."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SETTLED_")}
    return CliRunner(env={**clean, **env}).invoke(main, args, prog_name="settled")


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ")
    return line


# -- unknown variables ----------------------------------------------------------------------


def test_a_misspelt_variable_is_refused_with_the_nearest_name() -> None:
    assert unknown_variables({"SETTLED_DATABSE_URL": "x"}) == {
        "SETTLED_DATABSE_URL": "SETTLED_DATABASE_URL"
    }
    assert unknown_variables({"settled_brokr_url": "x"}) == {
        "settled_brokr_url": "SETTLED_BROKER_URL"
    }
    assert unknown_variables({"SETTLED_ZZZZZZZZZZZZZZZZZZZZ": "x"}) == {
        "SETTLED_ZZZZZZZZZZZZZZZZZZZZ": None
    }


def test_settings_other_variables_and_the_test_suites_are_not_unknown() -> None:
    known = {f"SETTLED_{n.upper()}": "x" for n in Settings.model_fields}
    known |= dict.fromkeys(OTHER_VARIABLES, "x")
    known |= {"SETTLED_TEST_DATABASE_URL": "x", "settled_database_url": "x", "HOME": "x"}
    known["_SETTLED_COMPLETE"] = "bash_source"  # click's completion, not ours
    assert unknown_variables(known) == {}


def test_reading_the_settings_refuses_an_unknown_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SETTLED_DATABSE_URL", "postgresql+psycopg://u:pw-not-shown@h/db")
    with pytest.raises(InvalidSetting) as caught:
        Settings(database_url="sqlite:///x.sqlite3")
    assert caught.value.code == "unknown_setting"
    assert caught.value.message == (
        "unknown setting SETTLED_DATABSE_URL; did you mean SETTLED_DATABASE_URL?"
    )


#: ``SETTLED_``-prefixed words in the repository that are not variables: a statement's name
#: (outbox/storage/overview.py), and the misspellings the docs and these tests show.
NOT_VARIABLES = {"SETTLED_SINCE", "SETTLED_DATABSE_URL", "SETTLED_ZZZZZZZZZZZZZZZZZZZZ"}
#: Files that name variables of earlier releases on purpose.
HISTORY = {"CHANGELOG.md"}


def test_every_settled_variable_the_repository_uses_is_known() -> None:
    """Tests, scripts, CI, compose, the Dockerfile, examples, bench and docs name no variable
    the settings would refuse (a prefix, e.g. ``SETTLED_CONSOLE_*``, is not a name)."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    used: dict[str, str] = {}
    for name in files:
        path = ROOT / name
        if name in HISTORY or not path.is_file() or path.suffix in (".png", ".ico", ".woff2"):
            continue
        for word in re.findall(
            r"(?<![A-Za-z0-9_])SETTLED_[A-Z0-9_]*[A-Z0-9]\b(?!_)", path.read_text(errors="replace")
        ):
            used.setdefault(word, name)
    assert len(used) > 40  # the scan found the settings themselves
    unknown = {
        word: where
        for word, where in used.items()
        if word not in NOT_VARIABLES and unknown_variables({word: "x"})
    }
    assert unknown == {}


@pytest.mark.parametrize("args", list(STARTS.values()), ids=list(STARTS))
def test_every_start_refuses_a_misspelt_database_url_and_creates_no_database(
    workdir: Path, db_url: str, args: list[str]
) -> None:
    result = run(args, {"SETTLED_DATABSE_URL": db_url})
    line = one_line_error(result)
    assert line.endswith(
        "unknown setting SETTLED_DATABSE_URL; did you mean SETTLED_DATABASE_URL?"
    ), line
    assert list(workdir.iterdir()) == []  # no ./settled.sqlite3


@pytest.mark.parametrize("args", [["db", "upgrade"], ["db", "current"]], ids=" ".join)
def test_db_commands_refuse_a_misspelt_database_url_and_create_nothing(
    workdir: Path, db_url: str, args: list[str]
) -> None:
    line = one_line_error(run(args, {"SETTLED_DATABSE_URL": db_url}))
    assert "did you mean SETTLED_DATABASE_URL?" in line
    assert list(workdir.iterdir()) == []


# -- what the preflight refuses -------------------------------------------------------------

MISCONFIGURED = {
    "stripe without keys": (
        {"SETTLED_DOWNSTREAM_PROVIDERS": '{"refund": "stripe"}'},
        "SETTLED_STRIPE_API_KEYS is empty",
    ),
    "lease shorter than a send": (
        {"SETTLED_LEASE_SECONDS": "5", "SETTLED_DOWNSTREAM_TIMEOUT": "10"},
        "SETTLED_LEASE_SECONDS (5 s) is shorter than SETTLED_DOWNSTREAM_TIMEOUT (10 s)",
    ),
    "downstream url without scheme": (
        {"SETTLED_DOWNSTREAM_URL": "payments.internal:8700"},
        "SETTLED_DOWNSTREAM_URL must be an http:// or https:// URL",
    ),
    "stripe base without scheme": (
        {
            "SETTLED_DOWNSTREAM_PROVIDERS": '{"refund": "stripe"}',
            "SETTLED_STRIPE_API_KEYS": '{"acme": "sk_test_not_shown"}',
            "SETTLED_STRIPE_API_BASE": "api.stripe.com",
        },
        "SETTLED_STRIPE_API_BASE must be an http:// or https:// URL",
    ),
    "broker typo": (
        {"SETTLED_BROKER_URL": "redsi://:broker-pw-not-shown@127.0.0.1:6399/0"},
        "SETTLED_BROKER_URL has no known transport 'redsi://'; did you mean redis://?",
    ),
}


@pytest.mark.parametrize("case", list(MISCONFIGURED), ids=list(MISCONFIGURED))
@pytest.mark.parametrize("args", list(STARTS.values()), ids=list(STARTS))
def test_every_start_refuses_a_misconfiguration_in_one_line(
    workdir: Path, db_url: str, args: list[str], case: str
) -> None:
    env, expected = MISCONFIGURED[case]
    result = run(args, {"SETTLED_DATABASE_URL": db_url, "SETTLED_AGENT_TENANT": "acme", **env})
    line = one_line_error(result)
    assert expected in line, line
    assert "not_shown" not in result.output and "not-shown" not in result.output
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("args", list(STARTS.values()), ids=list(STARTS))
def test_every_start_refuses_the_development_secrets_against_postgresql(
    workdir: Path, args: list[str]
) -> None:
    url = "postgresql+psycopg://settled:pw-never-echoed@127.0.0.1:1/settled"
    result = run(args, {"SETTLED_DATABASE_URL": url, "SETTLED_AGENT_TENANT": "acme"})
    line = one_line_error(result)
    assert "SETTLED_FINGERPRINT_KEYS and SETTLED_IDEMPOTENCY_SECRET" in line
    assert "pw-never-echoed" not in result.output


@pytest.mark.parametrize("args", list(STARTS.values()), ids=list(STARTS))
def test_every_start_refuses_a_database_file_that_does_not_exist_and_creates_none(
    workdir: Path, args: list[str]
) -> None:
    result = run(args, {"SETTLED_AGENT_TENANT": "acme"})  # the default: ./settled.sqlite3
    assert "run `settled db upgrade`" in one_line_error(result)
    assert list(workdir.iterdir()) == []


def test_the_app_refuses_the_development_secrets_against_postgresql() -> None:
    pg = "postgresql+psycopg://settled@db/settled"
    with pytest.raises(InvalidSetting) as caught:
        Outbox.from_settings(Settings(database_url=pg))
    assert caught.value.code == "development_secrets"
    assert "SETTLED_FINGERPRINT_KEYS and SETTLED_IDEMPOTENCY_SECRET" in caught.value.message
    Outbox.from_settings(Settings(database_url=pg, development=True))  # said on purpose
    Outbox.from_settings(Settings(database_url="sqlite:///x.sqlite3"))  # the embedded default


# -- what a start says ----------------------------------------------------------------------


def test_check_passes_and_names_the_database_its_schema_and_the_broker(
    workdir: Path, db_url: str
) -> None:
    result = run(["check"], {"SETTLED_DATABASE_URL": db_url, "SETTLED_BROKER_URL": "filesystem://"})
    assert result.exit_code == 0, result.output
    path = db_url.removeprefix("sqlite:///")
    assert result.stdout.splitlines() == [
        f"settled check: database sqlite:///{path} at schema {HEAD}, broker filesystem://"
    ]


def test_a_start_line_masks_every_password() -> None:
    assert masked("postgresql+psycopg://settled:s3cret@db:5432/ops") == (
        "postgresql+psycopg://settled:***@db:5432/ops"
    )
    assert masked("redis://:s3cret@redis:6399/0") == "redis://:***@redis:6399/0"
    assert masked("rediss://user:s3cret@redis:6380/1") == "rediss://user:***@redis:6380/1"
    assert masked("redis://redis:6399/0") == "redis://redis:6399/0"
    assert masked("sqlite:///settled.sqlite3") == f"sqlite:///{Path.cwd() / 'settled.sqlite3'}"


def test_db_upgrade_says_what_it_did_and_db_current_where_it_is(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ops.sqlite3'}"
    path = tmp_path / "ops.sqlite3"
    env = {"SETTLED_DATABASE_URL": url}
    current = run(["db", "current"], env)
    assert current.stdout.strip() == (
        f"sqlite:///{path} at nothing; newest {HEAD}: run `settled db upgrade`"
    )
    assert not path.exists()  # asking created nothing
    created = run(["db", "upgrade"], env)
    assert created.stdout.strip() == (
        f"created sqlite:///{path} and migrated it from nothing to {HEAD}"
    )
    again = run(["db", "upgrade"], env)
    assert again.stdout.strip() == f"sqlite:///{path} already at {HEAD}"
    assert run(["db", "current"], env).stdout.strip() == f"sqlite:///{path} at {HEAD} (the newest)"


def test_db_upgrade_from_an_older_schema_names_both_versions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ops.sqlite3'}"
    upgrade(url, "0003")
    result = run(["db", "upgrade"], {"SETTLED_DATABASE_URL": url})
    assert (
        result.stdout.strip()
        == f"migrated sqlite:///{tmp_path / 'ops.sqlite3'} from 0003 to {HEAD}"
    )


def test_db_upgrade_on_the_default_database_says_it_is_the_default(workdir: Path) -> None:
    result = run(["db", "upgrade"], {})
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"created sqlite:///{workdir / 'settled.sqlite3'} (the default: SETTLED_DATABASE_URL "
        f"is not set) and migrated it from nothing to {HEAD}"
    )
