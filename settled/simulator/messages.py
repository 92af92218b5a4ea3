"""An HTTP answer as a value: what the idempotency layer saves and replays."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Response:
    """An HTTP answer: a status, a JSON body and extra header fields."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str]


def error(
    status: int, type_: str, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer in the wire protocol's shape (README.md, "Errors")."""
    body = {"error": {"type": type_, "code": code, "message": message}}
    return Response(status, body, headers or {})
