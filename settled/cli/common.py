"""What every command of the command line shares: one-line errors, the checked input types
and the runtime built from the settings.

Bad input, bad configuration and refused actions end with one line on stderr (``Error: ...``)
and a non-zero exit status, never a traceback: values are checked at the edge (bounded
integers, text that is valid UTF-8), and what still goes wrong below is translated by
``OneLineErrors`` without quoting SQL parameters or secrets.
"""

from __future__ import annotations

import math
from typing import Any

import click

#: Largest value of a BIGINT column (PostgreSQL ids) and of an INTEGER one (item versions).
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1


class OneLineErrors(click.Group):
    """The root group: every error below it becomes one ``Error: ...`` line and an exit status
    (2 for usage errors, 1 for the rest), instead of click's usage banner or a traceback."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except Exception as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            raise _one_line(exc) from None


class _Failure(click.ClickException):
    """One ``Error: ...`` line; exit status 1."""


class _UsageFailure(click.ClickException):
    """One ``Error: ...`` line for a usage error; exit status 2, as click's own."""

    exit_code = 2


def _one_line(exc: Exception) -> Exception:
    """The one-line error for ``exc``; exceptions that are not errors of input, configuration
    or the environment (bugs) are returned unchanged, to keep their traceback."""
    import pydantic
    import pydantic_settings
    import sqlalchemy.exc

    from outbox.errors import SettledError

    if isinstance(exc, click.exceptions.NoArgsIsHelpError | click.exceptions.Exit):
        return exc  # the help text, or an exit status: not errors
    if isinstance(exc, click.UsageError):
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        return _UsageFailure(f"{where}{exc.format_message()}")
    if isinstance(exc, click.ClickException):
        return exc
    if isinstance(exc, SettledError):
        return _Failure(f"[{exc.code}] {exc.message}")
    if isinstance(exc, pydantic.ValidationError):
        from outbox.settings import settings_error

        return _Failure(settings_error(exc))  # never the input values: they may be secrets
    if isinstance(exc, pydantic_settings.SettingsError):
        return _Failure(f"invalid configuration: {exc}")  # names the field, not the value
    if isinstance(exc, sqlalchemy.exc.ArgumentError):
        return _Failure("invalid database URL")  # the URL itself may carry a password
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and _no_tables(exc):
        return _Failure("the database has no Settled tables: run `settled db upgrade`")
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        # The driver's own first line, never SQLAlchemy's text (it quotes the parameters).
        first = (str(exc.orig).strip().splitlines() or [""])[0][:200]
        return _Failure(f"database error ({type(exc.orig).__name__}): {first}")
    if isinstance(exc, UnicodeError):
        return _Failure("text input must be valid UTF-8")
    return exc


def _no_tables(exc: Any) -> bool:
    """A database error that says a Settled table does not exist (never migrated)."""
    name = type(exc.orig).__name__
    return name == "UndefinedTable" or (
        name == "OperationalError" and "no such table" in str(exc.orig)
    )


class Text(click.types.StringParamType):
    """A string that the database and the network can carry: valid UTF-8 (a byte that is not
    arrives as a lone surrogate), no NUL, at most ``max_length`` characters."""

    name = "text"

    def __init__(self, max_length: int = 2000) -> None:
        self.max_length = max_length

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = super().convert(value, param, ctx)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            self.fail("is not valid UTF-8 text", param, ctx)
        if "\x00" in text:
            self.fail("contains a NUL character", param, ctx)
        if len(text) > self.max_length:
            self.fail(f"is longer than {self.max_length} characters", param, ctx)
        return text


class Seconds(click.types.FloatParamType):
    """A finite, non-negative number of seconds that a ``timedelta`` can hold."""

    name = "seconds"
    largest = 100 * 365 * 86400.0

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds) or not 0 <= seconds <= self.largest:
            self.fail(f"must be between 0 and {self.largest:.0f} seconds", param, ctx)
        return seconds


TEXT = Text()
ITEM_ID = click.IntRange(1, BIGINT_MAX)
PORT = click.IntRange(1, 65535)
CONCURRENCY = click.IntRange(1, 256)
LOGLEVEL = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False)


def runtime(*, probe: bool = False) -> Any:
    """The runtime (engine, reconciler, review queue, ...) built from the settings, once they
    passed the preflight (``settled.preflight``; ``probe``: with the declared deadline fences
    probed, for a command that settles by itself); the caller closes it."""
    from outbox.settings import Settings
    from settled.preflight import preflight
    from settled.runtime import build_runtime

    settings = Settings()
    preflight(settings, broker=False, probe=probe)
    return build_runtime(settings)


def in_transaction(action: Any) -> Any:
    """Run ``action(session)`` in one transaction on the configured database."""
    from sqlalchemy.orm import Session

    from outbox.db import make_engine
    from outbox.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        with Session(engine) as session, session.begin():
            return action(session)
    finally:
        engine.dispose()


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    from outbox.db import schema_heads

    head = ", ".join(sorted(schema_heads("sqlite://")))
    click.echo(f"settled, version {version('settled')}, schema head {head}")
    ctx.exit()


#: ``--version``: the installed version and the newest migration it brings.
version_option = click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and the schema head, and exit.",
)
