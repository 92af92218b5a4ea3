"""The doorbell: on the one-operation-per-transaction path, fewer hint messages than operations.

Without it every committed transaction publishes its own hint, so an app that commits one
operation per request pays one Celery message (and one claim statement) per operation. With
it, a transaction publishes a hint only while fewer than ``pending`` of them wait in the queue;
otherwise the hints already waiting will find its operation. A doorbell hint carries no ids: the
worker that takes it answers the bell (the ring leaves the count) and claims the oldest due
operations, up to ``SETTLED_CLAIM_BATCH``; when its claim came back full, it rings again at
once, so that another worker takes the next batch while it sends this one. A transaction of
at least ``SETTLED_CLAIM_BATCH`` operations publishes its ids as without a doorbell: its hint
already carries as many as a doorbell hint would claim.

Why no operation is left behind: a producer whose ring is refused looked at the count after
its transaction committed, and saw ``pending`` rings that no worker had answered yet. Each of
those is answered later, and its claim then sees the operation. A claim that comes back full
may have left due operations behind: it rings again, and so on, until a claim comes back short,
which means it took every due operation it could see (``SKIP LOCKED`` skips only rows another
claim holds, and that claim is itself full or has taken them). What the argument does not
cover costs latency only, at most a sweeper period: a hint lost with its ring, a worker killed
between the answer and the claim, a claim that fails after the answer (the task ends, its hint
is acknowledged), a Redis that lost the count; a ring counts for ``ring_seconds`` at most, and
the sweeper re-hints every due operation each period, as for any lost hint. Operations that
become due later (a retry's backoff, a ``Retry-After``, one held back) are the sweeper's, with
the doorbell or without.

A worker answers doorbell hints whatever its own settings say: an app may ring while the
workers' ``SETTLED_HINT_DOORBELL`` or ``SETTLED_CLAIM_BATCH`` is 0 (their defaults are used for
those hints).

The count is a Redis sorted set on the broker (ring id -> Redis time in ms), changed by one
script per ring, so concurrent producers cannot both take the last place. A Redis error fails
open: the producer publishes its hint as if there were no doorbell; but not an error that
says the broker's Redis is unreachable (``unreachable``: a refused connection, a timeout),
which fails the hint at once, as publishing it would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from outbox.relay import Publish

log = logging.getLogger(__name__)

#: Keys on the broker's Redis: the pending rings, and the counter that numbers them.
KEY = "settled:doorbell"

# KEYS: the rings (zset), the ring counter. ARGV: most pending rings, ring lifetime in ms.
# Returns the new ring's id, or 0 when ``pending`` rings wait already.
_RING = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lifetime = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - lifetime)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
local id = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], now, id)
redis.call('PEXPIRE', KEYS[1], lifetime)
return id
"""


class Doorbell:
    """At most ``pending`` doorbell hints waiting at once; each counts ``ring_seconds`` at most.

    ``client`` is a ``redis.Redis`` on the broker (any object with ``register_script``,
    ``zpopmin`` and ``zrem``: fakeredis in unit tests).
    """

    def __init__(
        self, client: Any, *, pending: int, ring_seconds: float, claims: int, key: str = KEY
    ) -> None:
        if pending < 1:
            raise ValueError("pending must be at least 1")
        if claims < 1:
            raise ValueError("claims must be at least 1")
        if ring_seconds <= 0:
            raise ValueError("ring_seconds must be positive")
        self.client = client
        self.pending = pending
        #: operations a doorbell hint claims (``SETTLED_CLAIM_BATCH``): a hint carrying at
        #: least that many ids is published as it is, a doorbell hint would take no more
        self.claims = claims
        self.lifetime_ms = max(1, round(ring_seconds * 1000))
        self.key = key
        self._ring = client.register_script(_RING)

    def ring(self) -> int:
        """Take a place for one more pending hint: its ring id, or 0 if every place is taken
        (then a hint already waiting will find the caller's operations). Raises on a Redis
        error: the caller publishes anyway."""
        return int(
            self._ring(keys=[self.key, f"{self.key}:seq"], args=[self.pending, self.lifetime_ms])
        )

    def unring(self, ring: int) -> None:
        """Give back a place whose hint could not be published."""
        self.client.zrem(self.key, ring)

    def answer(self) -> None:
        """A worker took a doorbell hint: its ring (the oldest one) leaves the count. A Redis
        error is logged: the ring then leaves the count when its time is up."""
        try:
            self.client.zpopmin(self.key)
        except Exception:
            log.warning("doorbell not answered; its ring expires on its own", exc_info=True)


def rung(
    publish: Publish, bell: Doorbell, *, unreachable: tuple[type[Exception], ...] = ()
) -> Publish:
    """A relay ``publish`` that rings ``bell`` instead of publishing one hint per transaction:
    a doorbell hint (no ids) goes out only when the bell takes the ring. A hint of at least
    ``bell.claims`` ids (a transaction of many operations) is published as it is.

    ``unreachable``: errors of the bell that say the broker is unreachable; they are raised
    as they are (publishing would meet the same broker), any other publishes as is."""

    def publish_rung(operation_ids: Sequence[int]) -> None:
        if len(operation_ids) >= bell.claims:
            publish(operation_ids)
            return
        try:
            ring = bell.ring()
        except unreachable:
            raise
        except Exception:
            log.warning("doorbell unreachable; hint published as is", exc_info=True)
            publish(operation_ids)
            return
        if not ring:
            return  # a hint waiting in the queue will claim these operations
        try:
            publish([])
        except Exception:
            try:
                bell.unring(ring)
            except Exception:
                log.warning("doorbell ring not given back; it expires on its own", exc_info=True)
            raise

    return publish_rung


def ring_again(publish: Publish, bell: Doorbell) -> Callable[[], None]:
    """What a worker calls when a doorbell claim came back full: one more doorbell hint, if
    the bell takes the ring. Never raises (the sweeper covers a hint not published)."""
    again = rung(publish, bell)

    def ring() -> None:
        try:
            again([])
        except Exception:
            log.warning("doorbell hint not published; the sweeper will pick it up", exc_info=True)

    return ring
