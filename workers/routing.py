"""One gateway per kind: the downstream that serves each kind, chosen by configuration
(``SETTLED_DOWNSTREAM_PROVIDERS``); kinds not named go to the default gateway."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from outbox.clock import Deadline
from outbox.downstream import (
    DownstreamRequest,
    Gateway,
    LookupOutcome,
    SubmitOutcome,
)
from outbox.kinds import Kind
from outbox.port_shim import as_gateway, old_keywords


class GatewayByKind:
    """The ``Gateway`` port, each call passed to the gateway of its kind."""

    def __init__(self, default: Gateway, by_kind: Mapping[str, Gateway]) -> None:
        self.default = as_gateway(default, stacklevel=2)
        self.by_kind = {kind: as_gateway(g, stacklevel=2) for kind, g in by_kind.items()}

    def of(self, kind: Kind) -> Gateway:
        """The gateway that serves ``kind``."""
        return self.by_kind.get(kind.name, self.default)

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        return self.of(request.kind).submit(request, deadline=deadline)

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        return self.of(request.kind).lookup(request, deadline=deadline)

    def close(self) -> None:
        """Close every gateway that can be closed, each once."""
        seen: list[object] = []
        for gateway in [self.default, *self.by_kind.values()]:
            if any(gateway is other for other in seen):
                continue
            seen.append(gateway)
            close = getattr(gateway, "close", None)
            if close is not None:
                close()
