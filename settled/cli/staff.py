"""``settled staff``: the console's staff accounts (``support.accounts``).

A password is never an argument (it would sit in the shell's history and in ``ps``): it is
asked for twice at a prompt, or read as one line from stdin with ``--password-stdin``.
"""

from __future__ import annotations

import json
import sys

import click

from settled.cli.common import TEXT, Text, in_transaction

NAME = Text(max_length=64)
ROLES = click.Choice(["viewer", "support", "supervisor", "admin"])
password_stdin = click.option(
    "--password-stdin", is_flag=True, help="read the password as one line from stdin"
)


@click.group()
def staff() -> None:
    """Staff accounts of the support console (passwords stored as argon2id hashes)."""


def _password(from_stdin: bool) -> str:
    """The new password: one line of stdin, or typed twice at a hidden prompt."""
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    typed: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return typed


@staff.command("create")
@click.argument("name", type=NAME)
@click.option("--role", required=True, type=ROLES)
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    type=TEXT,
    help="a tenant this member may see (repeat; none: every tenant)",
)
@password_stdin
def staff_create(name: str, role: str, tenants: tuple[str, ...], password_stdin: bool) -> None:
    """Create the account NAME with ROLE (and, optionally, the only tenants it may see)."""
    from support.accounts import check_name, check_password, create_account

    check_name(name)  # before the prompt: a bad name is told at once
    password = check_password(_password(password_stdin))
    in_transaction(
        lambda s: create_account(s, name=name, password=password, role=role, tenants=tenants)
    )
    click.echo(f"created {name} ({role}; tenants: {', '.join(sorted(tenants)) or 'all'})")


@staff.command("disable")
@click.argument("name", type=NAME)
def staff_disable(name: str) -> None:
    """Disable NAME: it cannot sign in, and its open sessions end at once."""
    from support.accounts import disable_account

    in_transaction(lambda s: disable_account(s, name))
    click.echo(f"disabled {name}")


@staff.command("password")
@click.argument("name", type=NAME)
@password_stdin
def staff_password(name: str, password_stdin: bool) -> None:
    """Set a new password for NAME; its open sessions end."""
    from support.accounts import change_password, check_password

    password = check_password(_password(password_stdin))
    in_transaction(lambda s: change_password(s, name, password))
    click.echo(f"password changed for {name}")


@staff.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def staff_list(as_json: bool) -> None:
    """Every account: name, role, tenants, created, disabled (never a password hash)."""
    from dataclasses import asdict

    from support.accounts import list_accounts

    accounts = in_transaction(list_accounts)
    if as_json:
        click.echo(json.dumps([asdict(a) for a in accounts], indent=2, default=str))
        return
    for a in accounts:
        tenants = ",".join(a.tenants) if a.tenants is not None else "all tenants"
        state = f"disabled {a.disabled_at:%Y-%m-%d %H:%M}" if a.disabled_at else "active"
        click.echo(f"{a.name:<24} {a.role:<10} {tenants:<30} {state}")
    click.echo(f"{len(accounts)} account(s)")
