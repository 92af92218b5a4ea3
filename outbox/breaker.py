"""The hint breaker: an app's commit never waits on a broker that is down.

A hint is a wake-up only: beat's sweeper re-hints every due operation each
``SETTLED_SWEEP_SECONDS``, so a hint not published costs latency, never an operation. The
publish under the breaker is bounded already (one try, each broker round trip within
``SETTLED_HINT_TIMEOUT``: ``settled.celery_app.hint_publisher``). The breaker adds that after
a hint fails, the hints of the next ``cooldown`` seconds are skipped without touching the
broker; then one caller tries again (the others go on skipping while it does), and a success
closes the breaker.

Each hint is counted by its outcome (``count``): ``published``, ``failed`` (tried, and the
broker did not take it) or ``skipped`` (not tried: the breaker was open). An outage is logged
twice, whatever its length: a WARNING at its first failure, an INFO at the first hint
published after it, with how many hints were skipped and how many failed meanwhile. Neither
line carries the exception's text (it may name the broker), only its type.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from outbox.relay import HintNotPublished, Publish

log = logging.getLogger(__name__)

#: What a hint came to: published, tried and failed, or skipped while the breaker was open.
OUTCOMES = ("published", "failed", "skipped")


class HintBreaker:
    """A relay ``publish`` that stops calling ``publish`` for ``cooldown`` seconds after it
    failed, then tries once again. It raises ``HintNotPublished`` for a hint failed or skipped
    (``outbox.relay.publish_hints`` passes over it: logged here once per outage).

    ``broker`` names the broker in the log lines: give it without a password
    (``outbox.settings.masked``)."""

    def __init__(
        self,
        publish: Publish,
        *,
        cooldown: float,
        count: Callable[[str], None] = lambda outcome: None,
        broker: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if cooldown <= 0:
            raise ValueError("cooldown must be positive")
        self.publish = publish
        self.cooldown = cooldown
        self.count = count
        self.broker = broker
        self.monotonic = monotonic
        self._lock = threading.Lock()
        #: while open: when the next try may start (a caller that takes it moves it on)
        self._open_until: float | None = None
        #: when the outage began (its first failure), None while hints go through
        self._opened_at: float | None = None
        #: hints skipped and failed in this outage
        self.skipped = 0
        self.failed = 0

    @property
    def open(self) -> bool:
        """Whether hints are being skipped or tried once per cool-down (an outage)."""
        return self._opened_at is not None

    def __call__(self, operation_ids: Sequence[int]) -> None:
        with self._lock:
            now = self.monotonic()
            if self._open_until is not None:
                if now < self._open_until:
                    self.skipped += 1
                    self.count("skipped")
                    raise HintNotPublished
                # this caller tries; the others skip until it is done, and a cool-down more
                self._open_until = now + self.cooldown
        try:
            self.publish(operation_ids)
        except Exception as exc:
            self._failed(exc)
            raise HintNotPublished from None
        self._published(now)

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            now = self.monotonic()
            self._open_until = now + self.cooldown
            self.failed += 1
            first = self._opened_at is None
            if first:
                self._opened_at = now
        self.count("failed")
        if first:
            log.warning(
                "hints not published: the broker refused one or did not answer in time; "
                "skipping them, one tried per cool-down; the sweeper hints their operations",
                extra={
                    "error": type(exc).__name__,
                    "broker": self.broker,
                    "cooldown_seconds": self.cooldown,
                },
            )

    def _published(self, started: float) -> None:
        self.count("published")
        with self._lock:
            opened = self._opened_at
            # A hint that began before the outage's first failure proves nothing about now.
            if opened is None or started < opened:
                return
            skipped, failed = self.skipped, self.failed
            self._open_until = self._opened_at = None
            self.skipped = self.failed = 0
            lasted = self.monotonic() - opened
        log.info(
            "hints published again; the sweeper hinted the operations of those not published",
            extra={
                "broker": self.broker,
                "skipped": skipped,
                "failed": failed,
                "duration_ms": round(lasted * 1000),
            },
        )
