"""The submit path, one step at a time, numbered as in docs/wire-protocol.md, "Order of
processing a submit" (step 1's route and body are the HTTP layer's and ``app``'s):

1. authenticate (401); the deadline fence's probe (``Settled-Probe: deadline-fence``) that
   arrived after its ``Settled-Deadline`` answers ``408 deadline_exceeded`` here, before it is
   counted, before any fault and before its body or key are read (the ``deadline_fence``
   switch; switched off, a probe goes on as any submit and its body answers 400);
2. require an ``Idempotency-Key`` (400);
3. count the request and draw a fault (rules first, then the seeded schedule);
4. the faults before the idempotency layer: ``429``, ``403``, ``503_before``, ``reset_before``;
5. validate the body as an intent of the kind (400);
6. the idempotency layer: replay, ``idempotency_key_reused``, ``409 idempotency_key_in_use``;
   else the deadline fence: a request that arrived after its ``Settled-Deadline`` (by the
   simulator's clock) answers ``408 deadline_exceeded``, the key left unmarked and nothing
   executed (the ``deadline_fence`` switch); else mark the key in flight
   (``hold_before_commit`` holds here);
7. execute and save, in one transaction (``business_reject``, ``mismatched_receipt`` and
   ``503_after_commit`` change what is executed or saved);
8. the faults on the answer: ``commit_then_timeout``, ``commit_then_reset`` (replays too).

What each fault does is in ``injection``; a step that answers early raises ``Answer``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from outbox import wire
from outbox.errors import InvalidParams
from outbox.kinds import Kind
from settled.simulator.auth import authenticate
from settled.simulator.injection import Injection
from settled.simulator.messages import Answer, Connection, Request, Response, error, parse_json
from settled.simulator.state import Simulator

_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY.lower()
_DEADLINE = wire.DEADLINE.lower()
_PROBE = wire.PROBE.lower()

_KEY_MISSING = error(
    400, wire.INVALID_REQUEST, "idempotency_key_missing", "Idempotency-Key header is required"
)
_KEY_REUSED = error(
    400, wire.IDEMPOTENCY_ERROR, wire.KEY_REUSED, "this key was used with other parameters"
)
_KEY_IN_USE = error(
    409, wire.IDEMPOTENCY_ERROR, wire.KEY_IN_USE, "a request with this key is still in progress"
)
_DEADLINE_EXCEEDED = error(
    wire.DEADLINE_EXCEEDED_STATUS,
    wire.DEADLINE_ERROR,
    wire.DEADLINE_EXCEEDED,
    "the request arrived after its deadline; nothing was executed",
)


def submit(sim: Simulator, kind: Kind, request: Request, connection: Connection) -> Response:
    """Serve a submit of ``kind``."""
    # Read as the request arrives: the fence judges arrival, not how long it was then held.
    arrived = sim.now()
    tenant = authenticate(sim, request)
    deadline = request.fields.get(_DEADLINE)
    fenced = sim.switches.deadline_fence
    if (
        fenced
        and request.fields.get(_PROBE) == wire.PROBE_DEADLINE_FENCE
        and _past(deadline, arrived)
    ):
        raise Answer(_DEADLINE_EXCEEDED)  # the fence's probe: refused before anything else
    key = _idempotency_key(request)
    number = sim.count_request("submit", tenant, key, deadline)
    faults = Injection(sim, sim.faults.pick("submit", tenant, kind.name, key, number), connection)
    faults.before_idempotency()
    params = _intent(kind, request.body)
    fp = fingerprint(request.path, params)
    late = fenced and _past(deadline, arrived)
    replay = claim_key(sim, tenant, key, fp, late=late)
    if replay is not None:
        return faults.on_answer(replay)
    faults.before_commit()
    with faults.in_execution(kind) as scripted:
        execution = sim.ledger.execute(
            tenant=tenant,
            kind=kind.name,
            key=key,
            fingerprint=fp,
            params=params,
            now=sim.now(),
            scripted=scripted,
        )
    return faults.on_answer(execution.response)


def fingerprint(path: str, params: Mapping[str, Any]) -> str:
    """What "the same request" means for the idempotency layer: the path and the body."""
    canonical = json.dumps({"path": path, "params": params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _idempotency_key(request: Request) -> str:
    key = (request.fields.get(_IDEMPOTENCY_KEY) or "").strip()
    if not key or len(key) > 255:
        raise Answer(_KEY_MISSING)
    return key


def _intent(kind: Kind, body: bytes) -> Any:
    """The body, if it is a valid intent of ``kind``; answers 400 otherwise."""
    try:
        params = parse_json(body)
        kind.parse(params)
    except (ValueError, InvalidParams) as exc:
        code = exc.code if isinstance(exc, InvalidParams) else "body_not_json"
        raise Answer(
            error(400, wire.INVALID_REQUEST, code, "the request body is not a valid intent")
        ) from None
    return params


def claim_key(
    sim: Simulator, tenant: str, key: str, fp: str, *, late: bool = False
) -> Response | None:
    """The idempotency layer: the saved answer to replay, or None to execute (the key is then
    marked in flight). Answers 400 for a key used with other params, 409 for one in flight.

    ``late``: the request arrived after its deadline. A saved answer is still replayed (it
    proves what was done, and does nothing new); anything that would execute answers ``408
    deadline_exceeded`` instead, before the key is marked. With the ``idempotency`` switch off
    every request executes anew (a late one is refused).
    """
    if not sim.switches.idempotency:
        _refuse_if(late)
        return None
    with sim.idempotency_lock:
        record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
        if record is None:
            _refuse_if(late)
            sim.ledger.begin(tenant, key, fp, sim.now())
            return None
        if record.fingerprint != fp:
            raise Answer(_KEY_REUSED)
        if record.state == "in_flight":
            raise Answer(_KEY_IN_USE)
    if record.response is None:
        _refuse_if(late)
        return None  # a record that saved no answer: execute anew
    saved = record.response
    return replace(saved, headers={**saved.headers, wire.REPLAYED: "true"})


def _past(deadline: str | None, arrived: float) -> bool:
    """The request's ``Settled-Deadline`` had passed when it arrived (an absent or unreadable
    header sets no deadline)."""
    parsed = wire.parse_deadline(deadline) if deadline is not None else None
    return parsed is not None and arrived > parsed.timestamp()


def _refuse_if(late: bool) -> None:
    if late:
        raise Answer(_DEADLINE_EXCEEDED)
