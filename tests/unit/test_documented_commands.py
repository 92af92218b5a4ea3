"""Every ``settled`` command that the README, any page of docs/ (the guides of every reader,
docs/production.md among them), docker-compose.yml, the Dockerfile, the systemd units and
``settled run`` name exists: a command removed from the CLI (as ``web`` and ``apikey`` once were)
fails here, not in a user's terminal or a crash-looping container. A page added to docs/, or a
command moved from one page to another, is checked where it now is.

Mentions in prose and shell blocks are checked up to the command (their arguments are
placeholders); the command lines of compose, the Dockerfile, the guide's Kubernetes manifests,
the systemd units and ``settled run`` are parsed whole, options included.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from ruamel.yaml import YAML

from settled.cli import main

ROOT = Path(__file__).parents[2]

#: ``settled`` then the words after it that may name (sub)commands; an option, a placeholder
#: or punctuation ends the run. ``settled_operations`` (a metric) is not a mention.
MENTION = re.compile(r"(?<![\w-])settled(?![\w-])((?:[ \t]+[a-z][a-z0-9-]*)*)")


def resolve(words: list[str], where: str) -> tuple[click.Command, click.Context, list[str]]:
    """Walk the command tree along ``words``; return the command reached, its parent context
    and the words left over (arguments of that command)."""
    command: click.Command = main
    ctx = click.Context(main, info_name="settled")
    path = ["settled"]
    rest = list(words)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = command.get_command(ctx, name)
        assert sub is not None, f"{where}: `{' '.join(path)} {name}` is not a settled command"
        path.append(name)
        command = sub
        ctx = click.Context(sub, info_name=name, parent=ctx)
    return command, ctx, rest


def assert_runs(argv: list[str], where: str) -> None:
    """``argv`` (after ``settled``) names a command and its options parse, as when it is run."""
    command, ctx, rest = resolve(argv, where)
    if isinstance(command, click.Group) and "--help" not in rest:
        pytest.fail(f"{where}: `settled {' '.join(argv)}` names a group, not a command")
    try:
        command.make_context(ctx.info_name, rest, parent=ctx.parent)
    except click.exceptions.Exit as stop:  # --help
        if stop.exit_code != 0:
            pytest.fail(f"{where}: `settled {' '.join(argv)}` exits {stop.exit_code}")
    except click.UsageError as exc:
        pytest.fail(f"{where}: `settled {' '.join(argv)}`: {exc.format_message()}")


def code_of(markdown: str) -> str:
    """The code in a markdown text: fenced blocks and inline code spans."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", prose))


def mentions_in(path: Path) -> list[list[str]]:
    return [m.group(1).split() for m in MENTION.finditer(code_of(path.read_text()))]


def documents(root: Path) -> list[Path]:
    """The README and every page of docs/, in every folder."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def documented_mentions(root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """(the file, relative to ``root``; the words after ``settled``) of every mention in the
    README and the pages of docs/."""
    return [
        (str(path.relative_to(root)), words)
        for path in documents(root)
        for words in mentions_in(path)
    ]


GUIDE = ROOT / "docs" / "production.md"
#: The one command the guide documents before it exists here: it lands separately. Only
#: mentions starting with exactly these words are let through, and only while the command is
#: missing; once it exists it is checked like any other.
LANDS_SEPARATELY = ["ops", "prune"]


def resolve_in_guide(words: list[str]) -> None:
    try:
        resolve(words, "docs/production.md")
    except AssertionError:
        if words[: len(LANDS_SEPARATELY)] != LANDS_SEPARATELY:
            raise


def check_mention(where: str, words: list[str]) -> None:
    """A documented mention names a command (the guide's one exception aside)."""
    if where == "docs/production.md":
        resolve_in_guide(words)
    else:
        resolve(words, where)


def manifest_commands(path: Path) -> list[list[str]]:
    """``command: ["settled", ...]`` lines of the YAML blocks in ``path``, whole."""
    found = []
    for block in re.findall(r"^```yaml\n(.*?)^```", path.read_text(), re.S | re.M):
        for match in re.finditer(r"\bcommand: (\[.*?\])", block):
            words = json.loads(match.group(1))
            if words and words[0] == "settled":
                found.append([str(w) for w in words[1:]])
    return found


def unit_commands() -> dict[str, list[str]]:
    """The ``ExecStart`` of every systemd unit in deploy/systemd, after the ``settled`` binary."""
    found = {}
    for unit in sorted((ROOT / "deploy" / "systemd").glob("*.service")):
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                binary, *argv = line.removeprefix("ExecStart=").split()
                assert Path(binary).name == "settled", f"{unit.name}: {line}"
                found[unit.name] = argv
    return found


def compose_commands() -> dict[str, list[str]]:
    compose: dict[str, Any] = YAML(typ="safe").load((ROOT / "docker-compose.yml").read_text())
    commands = {}
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, str):
            command = command.split()
        if command and command[0] == "settled":
            commands[name] = [str(word) for word in command[1:]]
    return commands


def dockerfile_commands() -> list[list[str]]:
    commands = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        instruction, _, rest = line.partition(" ")
        if instruction not in ("CMD", "ENTRYPOINT", "RUN"):
            continue
        words = json.loads(rest) if rest.lstrip().startswith("[") else rest.split()
        if words and words[0] == "settled":
            commands.append(words[1:])
    return commands


def run_children(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> list[list[str]]:
    """The commands ``settled run ARGS`` starts, captured instead of started (after its
    preflight, on a migrated SQLite file and the filesystem broker)."""
    import settled.supervise
    from outbox.db import upgrade

    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    upgrade(url)
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SETTLED_")}
    env.update(SETTLED_DATABASE_URL=url, SETTLED_BROKER_URL="filesystem://")

    started: list[list[str]] = []

    def supervise(commands: list[list[str]], **_: Any) -> int:
        started.extend(list(c) for c in commands)
        return 0

    monkeypatch.setattr(settled.supervise, "supervise", supervise)
    result = CliRunner(env=env).invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output
    prefix = [sys.executable, "-m", "settled.cli"]
    assert all(c[:3] == prefix for c in started), started
    return [c[3:] for c in started]


def test_the_readme_and_the_docs_name_commands_that_exist() -> None:
    mentions = documented_mentions()
    named = {" ".join(words[:2]) for _, words in mentions}
    # What the guides document: if these are no longer found, the extraction broke.
    assert {
        "demo",
        "db upgrade",
        "db current",
        "check",
        "run",
        "worker",
        "beat",
        "web",
        "simulator",
        "apikey create",
        "apikey revoke",
        "ops list",
        "ops resubmit",
        "ops prune",
        "review list",
        "review resolve",
        "staff create",
        "proposals approve",
        "mcp",
    } <= named
    # Each reader's guide is read, wherever its commands are.
    assert {
        "README.md",
        "docs/running.md",
        "docs/configuration.md",
        "docs/support.md",
        "docs/agents.md",
        "docs/wire-protocol.md",
        "docs/production.md",
    } <= {where for where, _ in mentions}
    for where, words in mentions:
        check_mention(where, words)


def test_the_production_guide_names_commands_that_exist() -> None:
    mentions = mentions_in(GUIDE)
    named = {" ".join(m[:2]) for m in mentions}
    assert {"db upgrade", "worker", "beat", "web", "mcp", "staff create", "apikey create"} <= named
    assert " ".join(LANDS_SEPARATELY) in named  # the exception is used, and only for it
    for words in mentions:
        resolve_in_guide(words)


def test_a_missing_command_on_any_page_of_docs_is_caught(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("Run `settled demo`.\n")
    (tmp_path / "docs" / "new").mkdir(parents=True)
    (tmp_path / "docs" / "new" / "page.md").write_text(
        "A page nobody listed anywhere:\n\n"
        "```sh\nsettled review list\nsettled frobnicate --now\n```\n"
    )
    mentions = documented_mentions(tmp_path)
    assert mentions == [
        ("README.md", ["demo"]),
        ("docs/new/page.md", ["review", "list"]),
        ("docs/new/page.md", ["frobnicate"]),
    ]
    for where, words in mentions[:2]:
        check_mention(where, words)
    with pytest.raises(
        AssertionError, match=re.escape("docs/new/page.md: `settled frobnicate` is not a")
    ):
        check_mention(*mentions[2])


def test_the_production_guides_manifests_run_commands_that_exist() -> None:
    commands = manifest_commands(GUIDE)
    assert [c[0] for c in commands] == ["db", "worker", "beat", "web", "mcp"]
    for argv in commands:
        assert_runs(argv, "docs/production.md (Kubernetes)")


def test_the_systemd_units_run_commands_that_exist() -> None:
    commands = unit_commands()
    assert set(commands) == {
        f"settled-{name}.service" for name in ("migrate", "worker", "beat", "web", "mcp")
    }
    for unit, argv in commands.items():
        assert_runs(argv, f"deploy/systemd/{unit}")


def test_the_guides_exception_is_only_for_the_command_that_lands_separately() -> None:
    resolve_in_guide(["ops", "prune", "--older-than"])  # let through while it is missing
    for words in (["ops", "purge"], ["prune"], ["opsprune"]):
        with pytest.raises(AssertionError, match="is not a settled command"):
            resolve_in_guide(words)


def test_the_compose_services_run_commands_that_exist() -> None:
    commands = compose_commands()
    assert {"migrate", "simulator", "worker", "beat", "web"} <= set(commands)
    for service, argv in commands.items():
        assert_runs(argv, f"docker-compose.yml service {service}")


def test_the_dockerfile_runs_commands_that_exist() -> None:
    commands = dockerfile_commands()
    assert commands, "the Dockerfile no longer runs settled"
    for argv in commands:
        assert_runs(argv, "Dockerfile")


def test_settled_run_starts_commands_that_exist(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    children = run_children(monkeypatch, tmp_path, "--web-port=8123", "--concurrency=3")
    assert [c[0] for c in children] == ["worker", "beat", "web"]
    assert "--port=8123" in children[2]
    for argv in children:
        assert_runs(argv, "settled run")


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["nosuch"], "`settled nosuch` is not a settled command"),
        (["apikey", "rotate"], "`settled apikey rotate` is not a settled command"),
        (["db"], "names a group"),
        (["worker", "--no-such-option"], "No such option"),
    ],
)
def test_the_check_itself_catches_a_missing_command(argv: list[str], error: str) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(error)):
        assert_runs(argv, "test")


def test_a_readme_mention_of_a_missing_command_is_caught() -> None:
    text = "Start it with `settled serve --port 80`, then `settled_operations` is scraped."
    (words,) = [m.group(1).split() for m in MENTION.finditer(code_of(text))]
    assert words == ["serve"]
    with pytest.raises(AssertionError, match="`settled serve` is not a settled command"):
        resolve(words, "text")
