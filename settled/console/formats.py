"""How the console writes amounts, ages, times and staff actors, and raw JSON for its
"details" blocks: pure, for the templates."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup

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


def instant(at: str | datetime) -> datetime:
    """``at`` (an ISO string or a datetime; naive means UTC) as an aware UTC datetime."""
    moment = datetime.fromisoformat(at) if isinstance(at, str) else at
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def iso_z(at: str | datetime) -> str:
    """The machine form a ``<time datetime>`` carries: ``2026-12-03T06:14:16Z`` (whole
    seconds: the console shows no microseconds anywhere)."""
    return instant(at).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def exact(at: str | datetime) -> str:
    """The exact time as a person reads it, in UTC: ``2026-12-03 06:14:16 UTC``."""
    return instant(at).strftime("%Y-%m-%d %H:%M:%S UTC")


#: how long ago (or how long until), by language: (past, future, just now)
_RELATIVE = {
    "en": ("{n} {unit} ago", "in {n} {unit}", "just now"),
    "zh": ("{n} {unit}前", "{n} {unit}后", "刚刚"),
}
_UNITS = {
    "en": {"s": "s", "min": "min", "h": "h", "d": "d"},
    "zh": {"s": "秒", "min": "分钟", "h": "小时", "d": "天"},
}


def ago(at: str | datetime, now: datetime, lang: str = "en") -> str:
    """``at`` relative to ``now``, coarsely: ``just now``, ``45 s ago``, ``3 min ago``,
    ``2 h ago``, ``5 d ago``, ``in 12 min`` (a deadline); zh: ``3 分钟前``, ``12 分钟后``.
    ``static/times.js`` applies the same rules in the browser as time passes."""
    past, future, now_text = _RELATIVE.get(lang, _RELATIVE["en"])
    units = _UNITS.get(lang, _UNITS["en"])
    seconds = int((instant(now) - instant(at)).total_seconds())
    size = abs(seconds)
    if size < 10:
        return now_text
    if size < 60:
        n, unit = size, "s"
    elif size < 3600:
        n, unit = size // 60, "min"
    elif size < 86400:
        n, unit = size // 3600, "h"
    else:
        n, unit = size // 86400, "d"
    return (past if seconds >= 0 else future).format(n=n, unit=units[unit])


def when(
    at: str | datetime | None, now: datetime, lang: str = "en", *, precise: bool = False
) -> Markup:
    """A ``<time>`` element: the relative text, the exact UTC time in its title (the
    browser's ``times.js`` rewrites the title in the viewer's zone); ``precise``: the exact
    time as its text and the relative one in its title. Empty for None."""
    if at is None:
        return Markup("")
    relative, shown = ago(at, now, lang), exact(at)
    if precise:
        return Markup('<time class="exact" datetime="{}" title="{}">{}</time>').format(
            iso_z(at), relative, shown
        )
    return Markup('<time datetime="{}" title="{}">{}</time>').format(iso_z(at), shown, relative)


def _trimmed(value: Any) -> Any:
    """``value`` with every ISO timestamp string cut to whole seconds in UTC (``...Z``)."""
    if isinstance(value, dict):
        return {k: _trimmed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_trimmed(v) for v in value]
    if isinstance(value, str) and _TIMESTAMP.fullmatch(value):
        return iso_z(value)
    return value


_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?")


def raw(value: Any) -> str:
    """``value`` as indented JSON for a "details" block, its timestamps to the second."""
    return json.dumps(_trimmed(value), indent=2, ensure_ascii=False, sort_keys=False)
