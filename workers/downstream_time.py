"""The downstream's time as each gateway's answers say it, told to the process's clock watch.

Every gateway reads its downstream's time from what that downstream's answers carry, at the
precision it allows: the wire protocol's ``Settled-Server-Time`` (milliseconds; ``Date`` where
it is absent: ``outbox.wire.server_time``), HTTP's ``Date`` for Stripe and Alipay (whole
seconds: ``outbox.wire.http_date``), WeChat Pay's signed ``Wechatpay-Timestamp`` (whole
seconds, read only once the answer's signature verifies: ``workers.wechatpay_signing``). Each
says it here, the one place that turns an answer's time into what the clock watch measures
(``outbox.clock_steps.ClockWatch.downstream_answered``): the time said, its resolution, and
the database's time at the request's start and at the answer's arrival, read on the
attempt's deadline (``outbox.clock.Deadline.time_at``: ahead of the database's clock, never
behind). The resolution is what keeps a whole second's rounding from looking like a lag
(``outbox.downstream_clock.lag_of``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from outbox.clock import Deadline

#: Told the downstream's time an answer says: the downstream (the kind's name), the time said,
#: its resolution (seconds: the true time lies in ``[said, said + resolution)``), and the
#: database's time (estimated from the attempt's deadline) at the request's start and at the
#: answer's arrival (``outbox.clock_steps.ClockWatch.downstream_answered``).
TimeSeen = Callable[[str, datetime, float, datetime, datetime], object]
#: The lag (seconds; at most) the newest answer of a downstream showed its clock behind the
#: database's, by the downstream's name; None: not measured
#: (``outbox.downstream_clock.DownstreamClocks.latest``).
LagSeen = Callable[[str], float | None]


def tell_time(
    time_seen: TimeSeen | None,
    downstream: str,
    said: tuple[datetime, float] | None,
    until: Deadline,
    began: float,
) -> None:
    """Tell ``time_seen`` the time ``said`` (with its resolution) by an answer of
    ``downstream`` to a request that started at ``began`` on ``until``'s monotonic clock and
    whose answer has just arrived; nothing where no one listens or the answer said no time
    (a downstream that says none: its clock is assumed within the clock margin)."""
    if time_seen is None or said is None:
        return
    when, resolution = said
    arrived = until.monotonic()
    time_seen(downstream, when, resolution, until.time_at(began), until.time_at(arrived))
