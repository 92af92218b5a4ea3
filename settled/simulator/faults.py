"""Scripted, reproducible faults: rules by key pattern and a seeded probabilistic schedule."""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

Phase = Literal["submit", "lookup"]


class Fault(enum.StrEnum):
    COMMIT_THEN_TIMEOUT = "commit_then_timeout"  # execute, then hold the response
    COMMIT_THEN_RESET = "commit_then_reset"  # execute, then TCP RST
    RESET_BEFORE = "reset_before"  # TCP RST, nothing executed
    UNAVAILABLE_BEFORE = "503_before"  # 503 not_processed, nothing saved
    UNAVAILABLE_AFTER_COMMIT = "503_after_commit"  # execute, answer 503 (saved, replayed)
    SAVED_500 = "500_saved"  # fail before executing, answer 500 (saved, replayed): no effect
    SLOW_BODY = "slow_body"  # answer, the body one byte per hold_seconds (replays too)
    REFUND_STATUS = "refund_status"  # Stripe mode: the refund is made with status ``code``
    RATE_LIMITED = "429"  # 429 with Retry-After, before the idempotency layer
    FORBIDDEN = "403"  # 403 permission_error (a key not allowed to do this), nothing saved
    BUSINESS_REJECT = "business_reject"  # execute as a business refusal (saved, replayed)
    MISMATCHED_RECEIPT = "mismatched_receipt"  # execute; the receipt echoes a wrong field
    HOLD_BEFORE_COMMIT = "hold_before_commit"  # key in flight, held before executing
    LOOKUP_UNAVAILABLE = "lookup_unavailable"  # the lookup answers 503

    @property
    def phase(self) -> Phase:
        return "lookup" if self is Fault.LOOKUP_UNAVAILABLE else "submit"


@dataclass(frozen=True)
class Rule:
    """Inject ``fault`` into requests whose idempotency key matches ``pattern`` (a glob)."""

    fault: Fault
    pattern: str = "*"
    kind: str | None = None
    tenant: str | None = None
    times: int | None = None  # None: every matching request
    retry_after: str | None = None  # 429: the Retry-After value (seconds or HTTP-date)
    hold_seconds: float | None = None  # holds: the longest hold (default 30 s)
    field: str | None = None  # mismatched_receipt: the field echoed wrong (default amount)
    code: str | None = None  # business_reject: the business code

    def matches(self, phase: Phase, tenant: str, kind: str, key: str) -> bool:
        return (
            self.fault.phase == phase
            and (self.tenant is None or self.tenant == tenant)
            and (self.kind is None or self.kind == kind)
            and fnmatch.fnmatchcase(key, self.pattern)
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fault": self.fault.value}


@dataclass(frozen=True)
class Schedule:
    """Faults drawn with probabilities, deterministic per (seed, tenant, key, request number)."""

    seed: int
    probabilities: Mapping[Fault, float]
    kind: str | None = None
    tenant: str | None = None
    retry_after: str | None = None
    hold_seconds: float | None = None

    def __post_init__(self) -> None:
        if any(p < 0 for p in self.probabilities.values()):
            raise ValueError("probabilities must not be negative")
        for phase in ("submit", "lookup"):
            if sum(p for f, p in self.probabilities.items() if f.phase == phase) > 1:
                raise ValueError(f"{phase} probabilities add up to more than 1")

    def draw(self, phase: Phase, tenant: str, kind: str, key: str, number: int) -> Fault | None:
        """The fault for the ``number``-th ``phase`` request with ``key`` (None: no fault)."""
        if (self.tenant is not None and self.tenant != tenant) or (
            self.kind is not None and self.kind != kind
        ):
            return None
        material = f"{self.seed}\x00{phase}\x00{tenant}\x00{key}\x00{number}".encode()
        u = int.from_bytes(hashlib.sha256(material).digest()[:8], "big") / 2**64
        edge = 0.0
        for fault in sorted(self.probabilities, key=lambda f: f.value):
            if fault.phase != phase:
                continue
            edge += self.probabilities[fault]
            if u < edge:
                return fault
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "probabilities": {f.value: p for f, p in self.probabilities.items()},
        }


@dataclass
class FaultBook:
    """The active rules and schedule; rules win over the schedule. Thread-safe."""

    _rules: dict[int, Rule] = field(default_factory=dict)
    _left: dict[int, int | None] = field(default_factory=dict)
    _schedule: Schedule | None = None
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_rule(self, rule: Rule) -> int:
        with self._lock:
            rule_id = self._next_id
            self._next_id += 1
            self._rules[rule_id] = rule
            self._left[rule_id] = rule.times
            return rule_id

    def set_schedule(self, schedule: Schedule | None) -> None:
        with self._lock:
            self._schedule = schedule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._left.clear()
            self._schedule = None

    def pick(self, phase: Phase, tenant: str, kind: str, key: str, number: int) -> Rule | None:
        """The fault for this request; a rule that fires spends one of its ``times``."""
        with self._lock:
            for rule_id, rule in self._rules.items():
                left = self._left[rule_id]
                if (left is None or left > 0) and rule.matches(phase, tenant, kind, key):
                    if left is not None:
                        self._left[rule_id] = left - 1
                    return rule
            schedule = self._schedule
        if schedule is None:
            return None
        fault = schedule.draw(phase, tenant, kind, key, number)
        if fault is None:
            return None
        return replace(
            Rule(fault), retry_after=schedule.retry_after, hold_seconds=schedule.hold_seconds
        )

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rules": [
                    {"id": i, **r.as_dict(), "left": self._left[i]} for i, r in self._rules.items()
                ],
                "schedule": self._schedule.as_dict() if self._schedule else None,
            }
