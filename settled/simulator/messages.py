"""What the HTTP layer and the application exchange: a request, its answer, the connection.

The application answers a ``Request`` with a ``Response`` (the idempotency layer saves answers as
they are and replays them); a step that answers early raises ``Answer``, as a web framework's
HTTPException. Through ``Connection`` it may instead drop the connection with a TCP reset, or
watch whether the client hung up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from outbox import wire


@dataclass(frozen=True, slots=True)
class Request:
    """One request as read from the connection."""

    method: str
    path: str  # without the query string
    #: header fields by lower-case name (the first of repeated fields)
    fields: Mapping[str, str]
    body: bytes
    query: str = ""  # the query string, without the "?"


@dataclass(frozen=True)
class Response:
    """An HTTP answer: a status, a JSON body and extra header fields."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    #: the pause before each byte of the body (the ``slow_body`` fault); None: one write
    pace: float | None = None
    #: whether the answer says ``Settled-Server-Time`` (the wire protocol's answers); a
    #: provider mode's answer says only ``Date``, as the provider does (``httpserver``)
    server_time: bool = True


class Answer(Exception):
    """Ends the processing of a request: ``response`` is its answer."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


class Connection(Protocol):
    """The connection a request came on, as the application may act on it."""

    def peer_closed(self) -> bool:
        """Whether the client hung up."""
        ...

    def reset(self) -> NoReturn:
        """Abort the connection with a TCP RST; the request gets no answer."""
        ...


def error(
    status: int, type_: str, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer in the wire protocol's shape (docs/wire-protocol.md, "Errors")."""
    body = {"error": {"type": type_, "code": code, "message": message}}
    return Response(status, body, headers or {})


NO_SUCH_ROUTE = error(404, wire.NOT_FOUND_ERROR, "no_such_route", "no such route")


class BadJSON(ValueError):
    """The body is not JSON the simulator can read."""


def parse_json(raw: bytes) -> Any:
    """The body as JSON; BadJSON for anything else, nesting too deep to decode included
    (the decoder recurses: a 64 KiB body of "[" would end the thread without an answer)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadJSON("body is not JSON") from exc
