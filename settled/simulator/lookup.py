"""The lookup by idempotency key and the list of effects (docs/wire-protocol.md, "Lookup by
idempotency key", "List of effects")."""

from __future__ import annotations

from urllib.parse import parse_qsl

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


def list_effects(sim: Simulator, request: Request) -> Response:
    """``GET /v1/effects?since=T``: the tenant's executed effects created at or after ``T``
    (Unix seconds), oldest first, a page at a time (``limit`` 1-100, default 100;
    ``starting_after`` the last id of the page before); ``has_more`` where more follow. Listed
    for as long as the ledger holds them (the key retention does not apply; the visibility
    delay does)."""
    tenant = authenticate(sim, request)
    if not sim.switches.effects_list:
        return _NO_LOOKUP_API
    query = dict(parse_qsl(request.query))
    since, limit = _number(query.get("since", "0")), _number(query.get("limit", "100"))
    if since is None or limit is None or not 1 <= limit <= wire.EFFECTS_PAGE_MAX:
        return error(400, wire.INVALID_REQUEST, "invalid_params", "since or limit is not valid")
    now = sim.now()
    listed = sorted(
        (
            (created, outcome)
            for created, outcome in sim.ledger.outcomes(tenant)
            if outcome.get("status") == "succeeded"
            and created >= since
            and now - created >= sim.switches.lookup_visibility_delay
        ),
        key=lambda shown: (shown[0], str(shown[1].get("id"))),  # oldest first, ties by id
    )
    effects = [outcome for _, outcome in listed]
    after = query.get("starting_after")
    if after is not None:
        ids = [str(effect.get("id")) for effect in effects]
        if after not in ids:
            return error(400, wire.INVALID_REQUEST, "invalid_params", "starting_after is unknown")
        effects = effects[ids.index(after) + 1 :]
    page = effects[: int(limit)]
    body = {"object": "list", "has_more": len(effects) > limit, "data": page}
    return Response(200, body, {})


def _number(text: str) -> float | None:
    """A non-negative number of the query string (None: not one)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value >= 0 and value == value and value != float("inf") else None
