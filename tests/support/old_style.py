"""A user's adapter as written before ``DownstreamRequest``: every call in keywords (the form
``outbox.port_shim`` still accepts, with a warning, for one release)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from outbox import FakeGateway
from outbox.clock import Deadline
from outbox.downstream import DownstreamRequest, LookupOutcome, SubmitOutcome
from outbox.kinds import Kind


class OldStyle:
    """An old-style adapter over a ``FakeGateway``; ``given`` records each call."""

    def __init__(self) -> None:
        self.fake = FakeGateway()
        #: what each call was given, by name: (method, the type of ``params``)
        self.given: list[tuple[str, type]] = []

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
        self.given.append(("submit", type(params)))
        request = DownstreamRequest(tenant, op_id, kind, idempotency_key, params)
        return self.fake.submit(request, deadline=deadline)

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
        self.given.append(("lookup", type(params)))
        request = DownstreamRequest(tenant, op_id, kind, idempotency_key, params)
        return self.fake.lookup(request, deadline=deadline)
