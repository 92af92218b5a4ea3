"""Helpers for simulator tests (kept apart from the fixture plugin so tests can import them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from pydantic import SecretStr

from outbox.kinds import KindRegistry, default_registry

#: Client timeout of the gateways in tests: short, so a held response costs half a second.
CLIENT_TIMEOUT = 0.5


def fenced(registry: KindRegistry | None = None) -> KindRegistry:
    """``registry`` (default: the default kinds) as the simulator serves them over the wire
    protocol: it refuses a request that arrives past its ``Settled-Deadline``, so each kind's
    contract declares the fence (``enforces_deadline``), and a "not found" counts from the
    attempt's lease end, without the delay bound."""
    registry = registry or default_registry()
    for name in registry.names():
        registry = registry.with_contract(name, enforces_deadline=True)
    return registry


@dataclass(frozen=True)
class SimTenant:
    """A tenant registered with the simulator, and its API key."""

    name: str
    api_key: SecretStr


def wait_until(
    condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail the test past ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)
