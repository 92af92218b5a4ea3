"""The control API, served in test mode only: a table of routes, (method, route) -> handler.

Each handler takes the simulator and the JSON body and returns the JSON answer; a body it cannot
use (a ValueError, TypeError, KeyError or OverflowError) answers 400 ``bad_control_request``.
The typed client is ``settled.simulator.control.SimulatorControl``; docs/wire-protocol.md,
"Control API" lists the routes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

from outbox import wire
from settled.simulator.faults import Fault, Rule, Schedule
from settled.simulator.messages import NO_SUCH_ROUTE, Response, error, parse_json
from settled.simulator.state import Simulator, Switches
from settled.simulator.stripe import move_refund

Handler = Callable[[Simulator, Mapping[str, Any]], dict[str, Any]]

_OK: dict[str, Any] = {"ok": True}


def respond(sim: Simulator, method: str, route: str, raw: bytes) -> Response:
    """Serve ``method`` on ``/_control/{route}`` with the body ``raw``."""
    try:
        data = parse_json(raw) if raw else {}
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        handler = ROUTES.get((method, route))
        if handler is None:
            return NO_SUCH_ROUTE
        result = handler(sim, data)
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        # OverflowError: a number too large for a float or for the ledger's integers.
        return error(400, wire.INVALID_REQUEST, "bad_control_request", str(exc))
    return Response(200, result, {})


# -- setup ----------------------------------------------------------------------------------


def _reset(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.reset()
    return _OK


def _add_tenant(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.ledger.add_tenant(_str(data, "tenant"), _str(data, "api_key"))
    return _OK


def _create_order(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    status = data.get("status", "open")
    if status not in ("open", "closed"):
        raise ValueError("status must be open or closed")
    amount = data["amount_minor"]
    if not isinstance(amount, int) or amount <= 0:
        raise ValueError("amount_minor must be a positive integer")
    sim.ledger.create_order(
        _str(data, "tenant"), _str(data, "order_id"), amount, _str(data, "currency"), status
    )
    return _OK


# -- faults ---------------------------------------------------------------------------------


def _add_rule(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": sim.faults.add_rule(_rule(data))}


def _clear_rules(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.faults.clear()
    return _OK


def _set_schedule(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.faults.set_schedule(_schedule(data))
    return _OK


def _clear_schedule(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.faults.set_schedule(None)
    return _OK


def _faults(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    return {**sim.faults.describe(), "injected": sim.injected()}


def _release(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.release_holds()
    return _OK


def _move_stripe_refund(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    reason = _opt(data, "failure_reason", str)
    move_refund(sim, _str(data, "tenant"), _str(data, "key"), _str(data, "status"), reason)
    return _OK


# -- switches and clock ---------------------------------------------------------------------


def _switches(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    return asdict(sim.switches)


def _change_switches(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    sim.switches = replace(sim.switches, **_switch_values(data))
    return asdict(sim.switches)


def _advance_clock(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    seconds = data["advance_seconds"]
    if not isinstance(seconds, (int, float)):
        raise ValueError("advance_seconds must be a number")
    sim.advance_clock(float(seconds))
    return {"now": sim.now()}


# -- ground truth ---------------------------------------------------------------------------


def _ledger(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    return {**sim.ledger.snapshot(), "requests": sim.requests(), "now": sim.now()}


def _add_alipay_app(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    tenant, app_id = _str(data, "tenant"), _str(data, "app_id")
    sim.alipay.add_app(app_id, tenant, _str(data, "app_public_key"))
    return _OK


def _alipay_keys(sim: Simulator, data: Mapping[str, Any]) -> dict[str, Any]:
    return {"alipay_public_key": sim.alipay.public_key_pem()}


#: (method, route below /_control/) -> handler
ROUTES: Mapping[tuple[str, str], Handler] = {
    ("POST", "reset"): _reset,
    ("POST", "tenants"): _add_tenant,
    ("POST", "orders"): _create_order,
    ("POST", "rules"): _add_rule,
    ("DELETE", "rules"): _clear_rules,
    ("POST", "schedule"): _set_schedule,
    ("DELETE", "schedule"): _clear_schedule,
    ("GET", "faults"): _faults,
    ("POST", "release"): _release,
    ("POST", "stripe_refunds"): _move_stripe_refund,
    ("GET", "switches"): _switches,
    ("POST", "switches"): _change_switches,
    ("POST", "clock"): _advance_clock,
    ("GET", "ledger"): _ledger,
    ("POST", "alipay_apps"): _add_alipay_app,
    ("GET", "alipay_keys"): _alipay_keys,
}


# -- reading bodies -------------------------------------------------------------------------


def _str(data: Mapping[str, Any], name: str) -> str:
    value = data[name]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _opt(data: Mapping[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if value is not None and not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type")
    return value


def _switch_values(data: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(data) - set(Switches.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown switches: {sorted(unknown)}")
    for name in ("idempotency", "lookup", "deadline_fence", "effects_list"):
        if name in data and not isinstance(data[name], bool):
            raise ValueError(f"{name} must be true or false")
    for name in ("key_retention_seconds", "lookup_visibility_delay"):
        value = data.get(name, 0)
        if name == "key_retention_seconds" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number")
    return dict(data)


def _rule(data: Mapping[str, Any]) -> Rule:
    unknown = set(data) - set(Rule.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown rule fields: {sorted(unknown)}")
    times = _opt(data, "times", int)
    if times is not None and times < 1:
        raise ValueError("times must be at least 1")
    return Rule(
        fault=Fault(data["fault"]),
        pattern=_opt(data, "pattern", str) or "*",
        kind=_opt(data, "kind", str),
        tenant=_opt(data, "tenant", str),
        times=times,
        retry_after=_opt(data, "retry_after", str),
        hold_seconds=_opt(data, "hold_seconds", (int, float)),
        field=_opt(data, "field", str),
        code=_opt(data, "code", str),
    )


def _schedule(data: Mapping[str, Any]) -> Schedule:
    probabilities = data["probabilities"]
    if not isinstance(probabilities, dict):
        raise ValueError("probabilities must be an object")
    seed = data["seed"]
    if not isinstance(seed, int):
        raise ValueError("seed must be an integer")
    return Schedule(
        seed=seed,
        probabilities={Fault(name): float(p) for name, p in probabilities.items()},
        kind=_opt(data, "kind", str),
        tenant=_opt(data, "tenant", str),
        retry_after=_opt(data, "retry_after", str),
        hold_seconds=_opt(data, "hold_seconds", (int, float)),
    )
