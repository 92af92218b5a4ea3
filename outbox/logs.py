"""Structured logs: one JSON object per line (or plain text for a terminal), with the
operation's identity as keys and never its parameters, payee or any secret.

Only allow-listed fields are written, so a careless ``log.info(..., extra=params)`` cannot
leak a payee into the logs. A field reaches a line three ways, all through the allow-list:

- ``extra=`` of the call itself;
- ``bound(...)``: fields of the code around the call (an operation being sent, a request);
- ``remember(...)``: an operation's identity, added to every line that names its
  ``operation_id`` but not its tenant, op id or kind.

An exception is written as its type only: exception texts may carry data.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

#: Fields that may appear in a log line: identities, counts, states, codes, durations.
ALLOWED = frozenset(
    {
        # an operation
        "operation_id",
        "op_id",
        "tenant",
        "kind",
        "key",
        "attempt",
        "proof",
        "state",
        "stop",
        "lease_version",
        "duration_ms",
        "error",
        # a pass of the executor, sweeper or reconciler
        "claimed",
        "outcomes",
        "oldest_unknown_seconds",
        "due",
        "hinted",
        "at",
        "count",
        # an outage of the app's hints (outbox.breaker)
        "skipped",
        "failed",
        "cooldown_seconds",
        # review queue and runs
        "item",
        "staff",
        "role",
        "lookup",
        "run",
        # HTTP: the downstream's answer, and the status API's access log
        "status",
        "method",
        "path",
        # a server process: where it listens
        "host",
        "port",
        "test_mode",
        # the simulator's provider keys made at its start (public: a key id, a key's hash)
        "wechatpay_platform_serial",
        "alipay_public_key_sha256",
        # a start: what it runs against (passwords masked: ``settled.preflight``)
        "command",
        "database",
        "schema",
        "broker",
        "fences_verified",
        # a step of the database's clock (outbox.clock_steps)
        "step_seconds",
        "direction",
        "distrust_until",
        "detected_by",
        # a database outage (outbox.outage): what waited, what was skipped, how long
        "waiting",
        "retried",
        "outage_seconds",
        "operations",
        # the primary's replication, said at a start (settled.preflight)
        "synchronous_commit",
        "synchronous_standby_names",
        "standbys",
        "async_replication_accepted",
        # tracing: the span a line was written in
        "trace_id",
        "span_id",
    }
)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_SCALAR = str | int | float | bool | None

_bound: ContextVar[Mapping[str, Any]] = ContextVar(
    "settled_log_fields", default=MappingProxyType({})
)


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (allow-listed ones only are written) to every line logged inside."""
    token = _bound.set({**_bound.get(), **fields})
    try:
        yield
    finally:
        _bound.reset(token)


class _Identities:
    """Operation identities by database id, the most recent ``size`` of them."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._by_id: OrderedDict[int, dict[str, str]] = OrderedDict()

    def remember(self, operation_id: int, **identity: str) -> None:
        with self._lock:
            self._by_id[operation_id] = identity
            self._by_id.move_to_end(operation_id)
            while len(self._by_id) > self.size:
                self._by_id.popitem(last=False)

    def get(self, operation_id: object) -> dict[str, str]:
        with self._lock:
            return self._by_id.get(operation_id, {}) if isinstance(operation_id, int) else {}


_identities = _Identities()


def remember(operation_id: int, *, tenant: str, op_id: str, kind: str) -> None:
    """Note an operation's identity: later lines naming its ``operation_id`` carry it too."""
    _identities.remember(operation_id, tenant=tenant, op_id=op_id, kind=kind)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The allow-listed fields of ``record``: bound ones, then the call's own ``extra``, then
    the remembered identity of its operation; values that are not scalars become text."""
    found: dict[str, Any] = {}
    for name, value in _bound.get().items():
        if name in ALLOWED:
            found[name] = value
    for name, value in vars(record).items():
        if name in ALLOWED and name not in _STANDARD:
            found[name] = value
    if "operation_id" in found:
        for name, value in _identities.get(found["operation_id"]).items():
            found.setdefault(name, value)
    span = _current_span_ids()
    if span is not None:
        found.setdefault("trace_id", span[0])
        found.setdefault("span_id", span[1])
    return {k: v if isinstance(v, _SCALAR) else str(v) for k, v in found.items()}


def _current_span_ids() -> tuple[str, str] | None:
    """The trace and span id of the current span, if OpenTelemetry is installed and one is."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:  # never imported here: nothing can be tracing
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, the allow-listed
    fields, and ``error`` (the exception's type) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(fields_of(record))
        if record.exc_info and record.exc_info[0] is not None:
            line["error"] = record.exc_info[0].__name__  # the type only: texts may carry data
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``: the same fields, for a person at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        fields = fields_of(record)
        if record.exc_info and record.exc_info[0] is not None:
            fields["error"] = record.exc_info[0].__name__
        pairs = "".join(f" {k}={json.dumps(v, ensure_ascii=False)}" for k, v in fields.items())
        return (
            f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}{pairs}"
        )


def from_environment(
    environ: Mapping[str, str] | None = None, *, default_level: str | None = None
) -> tuple[str, str]:
    """``SETTLED_LOG_LEVEL`` (``default_level`` when unset, else the setting's default) and
    ``SETTLED_LOG_FORMAT``, checked as ``Settings`` checks them (without reading any other
    setting: logging must work before the rest is valid)."""
    from pydantic import TypeAdapter, ValidationError

    from outbox.errors import InvalidInput
    from outbox.settings import LogFormat, LogLevel, Settings

    env = os.environ if environ is None else environ
    values: list[str] = []
    checked: tuple[tuple[str, Any], ...] = (("log_level", LogLevel), ("log_format", LogFormat))
    for name, kind in checked:
        variable = f"SETTLED_{name.upper()}"
        raw = env.get(variable)
        if raw is None:
            fallback = default_level if name == "log_level" else None
            values.append(fallback or str(Settings.model_fields[name].default))
            continue
        try:
            values.append(TypeAdapter(kind).validate_python(raw))
        except ValidationError:
            raise InvalidInput(
                f"{variable} must be one of {_choices(kind)}",
                code="invalid_setting",
                setting=variable,
            ) from None
    return values[0], values[1]


def _choices(kind: Any) -> str:
    from typing import get_args

    args = get_args(kind)
    literal = args[0] if args and hasattr(args[0], "__args__") else kind
    return ", ".join(get_args(literal))


#: Loggers of libraries that install handlers of their own: their lines go through ours.
_ADOPTED = ("uvicorn", "uvicorn.error", "uvicorn.access", "celery")
#: Settled's own packages: their lines pass at every level (their fields through the
#: allow-list, their messages written without data).
OWN = ("outbox", "workers", "reconciler", "support", "settled")
#: Other libraries whose lines at INFO are about the process, never about what it was given:
#: Celery's start, connection and task lines (a task's arguments are a hint's operation ids,
#: and its tasks return nothing), uvicorn's start and stop.
INFO_FROM = ("celery", "uvicorn.error")
#: Loggers that carry what they were given, silenced at every level. ``stripe``: the SDK logs
#: each request's URL (a lookup's names the payment intent, i.e. the order) and the
#: downstream's error message at INFO, and whole request and response bodies (amounts,
#: payees, metadata) at DEBUG.
SILENCED = ("stripe",)
#: Loggers kept to warnings, at any ``SETTLED_LOG_LEVEL``: request URLs (a lookup's names the
#: idempotency key) and headers (httpx, httpcore, urllib3), SQL with its parameters
#: (sqlalchemy), message bodies (kombu, amqp, mcp's sessions and transports), alembic's list of
#: its plugins at every start. Any other library's lines below WARNING are dropped too
#: (``ThirdPartyFilter``): these levels only save the work of making them.
QUIETED = (
    "httpx",
    "httpcore",
    "urllib3",
    "requests",
    "sqlalchemy",
    "kombu",
    "amqp",
    "mcp",
    "sse_starlette",
    "multipart",
    "asyncio",
    "alembic.runtime.plugins",
)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class ThirdPartyFilter(logging.Filter):
    """What other libraries may write: nothing from ``SILENCED``; warnings and errors from any
    other (their exceptions as the type only, like ours); INFO only from ``INFO_FROM``; never
    DEBUG. A library's message is its own text, which the allow-list cannot reach: a library
    that logs what it sends (a URL with an order id, a body with a payee, SQL parameters)
    must not be heard below WARNING, and ``SILENCED`` ones not at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if _under(name, OWN) or name == "py.warnings":
            return True
        if _under(name, SILENCED):
            return False
        if record.levelno >= logging.WARNING:
            return True
        return record.levelno >= logging.INFO and _under(name, INFO_FROM)


def configure(
    level: str | None = None, fmt: str | None = None, *, default_level: str | None = None
) -> None:
    """Send every log record to stderr, as JSON lines or text, at ``level``.

    Unset arguments come from ``SETTLED_LOG_LEVEL`` (else ``default_level``, else ``INFO``)
    and ``SETTLED_LOG_FORMAT`` (``json``). Safe to call again: the handler is replaced.
    """
    if level is None or fmt is None:
        env_level, env_fmt = from_environment(default_level=default_level)
        level, fmt = level or env_level, fmt or env_fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ThirdPartyFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _ADOPTED:
        adopted = logging.getLogger(name)
        adopted.handlers.clear()
        adopted.propagate = True
    for name in QUIETED:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in SILENCED:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    logging.captureWarnings(True)  # Python's warnings (Celery's, say) as lines of ours too
