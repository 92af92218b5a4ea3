"""Structured logs: one JSON object per line, with the operation's identity and never its
parameters, payee or any secret.

Only allow-listed ``extra`` fields are written, so a careless ``log.info(..., extra=params)``
cannot leak a payee into the logs.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

#: ``extra`` fields that may appear in a log line: identities, counts, states, codes.
ALLOWED = frozenset(
    {
        "operation_id",
        "op_id",
        "tenant",
        "key",
        "attempt",
        "proof",
        "state",
        "stop",
        "lease_version",
        "claimed",
        "outcomes",
        "oldest_unknown_seconds",
        "due",
        "hinted",
        "item",
        "staff",
        "role",
        "lookup",
        "status",
        "run",
        "count",
        "at",
    }
)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name in ALLOWED and name not in _STANDARD:
                line[name] = (
                    value if isinstance(value, str | int | float | bool | None) else str(value)
                )
        if record.exc_info and record.exc_info[0] is not None:
            line["error"] = record.exc_info[0].__name__  # the type only: texts may carry data
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(level: str = "INFO", *, json_lines: bool = True) -> None:
    """Send every log record to stderr, as JSON lines (or plain text for a terminal)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
