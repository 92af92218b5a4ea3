"""One gateway per kind: the downstream that serves each kind, chosen by configuration
(``SETTLED_DOWNSTREAM_PROVIDERS``); kinds not named go to the default gateway."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from outbox.clock import Deadline
from outbox.downstream import Gateway, LookupOutcome, SubmitOutcome
from outbox.kinds import Kind


class GatewayByKind:
    """The ``Gateway`` port, each call passed to the gateway of its kind."""

    def __init__(self, default: Gateway, by_kind: Mapping[str, Gateway]) -> None:
        self.default = default
        self.by_kind = dict(by_kind)

    def of(self, kind: Kind) -> Gateway:
        """The gateway that serves ``kind``."""
        return self.by_kind.get(kind.name, self.default)

    def submit(
        self,
        *,
        tenant: str,
        op_id: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: Deadline | datetime,
    ) -> SubmitOutcome:
        return self.of(kind).submit(
            tenant=tenant,
            op_id=op_id,
            kind=kind,
            idempotency_key=idempotency_key,
            params=params,
            deadline=deadline,
        )

    def lookup(
        self,
        *,
        tenant: str,
        op_id: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: Deadline | datetime,
    ) -> LookupOutcome:
        return self.of(kind).lookup(
            tenant=tenant,
            op_id=op_id,
            kind=kind,
            idempotency_key=idempotency_key,
            params=params,
            deadline=deadline,
        )

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
