"""What users of the simulator import and call, pinned: the package's exports, the control
client's methods, and the control API's routes (the same as the table of docs/wire-protocol.md)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import settled.simulator
from settled.simulator import SimulatorControl
from settled.simulator.control_api import ROUTES

WIRE_PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "wire-protocol.md"

EXPORTS = [
    "Fault",
    "Rule",
    "Schedule",
    "SimulatorControl",
    "SimulatorHandle",
    "Switches",
    "run",
    "start_in_thread",
]

CONTROL_METHODS = [
    "add_alipay_app",
    "add_rule",
    "add_tenant",
    "add_wechatpay_merchant",
    "advance_clock",
    "alipay_public_key",
    "clear_rules",
    "clear_schedule",
    "close",
    "create_order",
    "effect_counts",
    "effects",
    "faults",
    "in_flight",
    "injected",
    "ledger",
    "move_stripe_refund",
    "notify_wechatpay",
    "order_total",
    "refunded",
    "release_holds",
    "requests",
    "reset",
    "set_schedule",
    "set_switches",
    "switches",
    "wait_in_flight",
]


def test_the_package_exports_exactly_its_public_names() -> None:
    assert settled.simulator.__all__ == EXPORTS
    for name in EXPORTS:
        assert getattr(settled.simulator, name).__module__.startswith("settled.simulator.")


def test_the_control_client_keeps_its_methods() -> None:
    public = [
        name
        for name, _ in inspect.getmembers(SimulatorControl, inspect.isfunction)
        if not name.startswith("_")
    ]
    assert public == CONTROL_METHODS


def _documented_routes() -> set[tuple[str, str]]:
    """(method, route) of every row of docs/wire-protocol.md's control API table:
    "`POST /_control/x`", or "`GET` / `POST /_control/x`" for two methods on one route."""
    section = WIRE_PROTOCOL.read_text(encoding="utf-8").split("### Control API", 1)[1]
    routes = set()
    for row in re.findall(r"^\| (`[^|]*/_control/[^|]*`) \|", section, flags=re.MULTILINE):
        *methods, path = re.findall(r"[A-Z]+|/_control/\w+", row)
        routes |= {(method, path.removeprefix("/_control/")) for method in methods}
    return routes


def test_the_control_api_serves_the_routes_the_wire_protocol_documents() -> None:
    assert set(ROUTES) == _documented_routes()
    assert len(ROUTES) == 16
