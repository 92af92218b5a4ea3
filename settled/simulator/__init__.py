"""The payment service simulator: a downstream with Stripe-like idempotency, lookups and faults.

``run`` serves until interrupted (``settled simulator``); ``start_in_thread`` serves in the
background for tests and the demo; ``SimulatorControl`` drives its control API (test mode).
"""

from __future__ import annotations

from settled.simulator.control import SimulatorControl
from settled.simulator.faults import Fault, Rule, Schedule
from settled.simulator.server import SimulatorHandle, run, start_in_thread
from settled.simulator.state import Switches

__all__ = [
    "Fault",
    "Rule",
    "Schedule",
    "SimulatorControl",
    "SimulatorHandle",
    "Switches",
    "run",
    "start_in_thread",
]
