"""How the console writes amounts, ages and staff actors: pure, for the templates."""

from __future__ import annotations

from datetime import datetime

from outbox.currencies import format_amount

#: ``10000, "CNY"`` as ``100.00 CNY``; an empty string where the kind has no amount.
amount = format_amount


def age(since: str | datetime, now: datetime) -> str:
    """How long ago ``since`` was, coarsely: ``45 s``, ``12 min``, ``3 h 5 min``, ``2 d 4 h``."""
    start = datetime.fromisoformat(since) if isinstance(since, str) else since
    seconds = max(0, int((now - start).total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def who(actor: str | None) -> str:
    """``staff:ann`` as ``ann``; other actors (the reconciler, a worker) as they are."""
    return (actor or "").removeprefix("staff:")
