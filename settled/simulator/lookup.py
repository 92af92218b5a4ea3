"""The lookup by idempotency key (docs/wire-protocol.md, "Lookup by idempotency key")."""

from __future__ import annotations

from outbox import wire
from settled.simulator.auth import authenticate
from settled.simulator.injection import Injection
from settled.simulator.ledger import kind_of_object
from settled.simulator.messages import Connection, Request, Response, error
from settled.simulator.state import Simulator

_DEADLINE = wire.DEADLINE.lower()
_NO_LOOKUP_API = Response(404, {}, {})  # a bare 404, not "key not found"
_KEY_NOT_FOUND = error(404, wire.NOT_FOUND_ERROR, wire.KEY_NOT_FOUND, "no record of this key")


def lookup(sim: Simulator, key: str, request: Request, connection: Connection) -> Response:
    """The outcome recorded for ``key``: 200 with it, or 404 ``idempotency_key_not_found`` while
    there is none to show (never saved, in flight, not yet visible, or forgotten)."""
    tenant = authenticate(sim, request)
    if not sim.switches.lookup:
        return _NO_LOOKUP_API
    number = sim.count_request("lookup", tenant, key, request.fields.get(_DEADLINE))
    record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
    obj = record.outcome.get("object", "") if record and record.outcome else ""
    rule = sim.faults.pick("lookup", tenant, kind_of_object(str(obj)), key, number)
    Injection(sim, rule, connection).on_lookup()
    if record is None or record.outcome is None:
        return _KEY_NOT_FOUND
    if sim.now() - record.created < sim.switches.lookup_visibility_delay:
        return _KEY_NOT_FOUND
    return Response(200, record.outcome, {})
