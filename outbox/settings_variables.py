"""Which ``SETTLED_*`` variables an environment may hold: the settings' own, the few that
something else reads (``OTHER_VARIABLES``), the test suite's (``SETTLED_TEST_*``). Any other
is refused, naming the nearest valid one: a typo is never ignored."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from outbox.errors import InvalidSetting

#: ``SETTLED_*`` variables that are not settings, and what reads them. ``SETTLED_TEST_*`` belong
#: to the test suite (``tests/support``). Any other ``SETTLED_*`` variable is refused.
OTHER_VARIABLES = {
    "SETTLED_STAFF_ID": "settled review, settled proposals: the member of staff (--staff)",
    "SETTLED_STAFF_ROLE": "settled review: the staff's role (--role)",
    "SETTLED_SIMULATOR_TENANTS": "settled simulator: its tenants (--tenant)",
    "SETTLED_TRACING": "settled.tracing: 1 turns traces on",
    "SETTLED_FAILPOINT": "workers.failpoints: the step a crash test stops a worker at",
    "SETTLED_FAILPOINT_MARKER": "workers.failpoints: the file a failpoint leaves",
    "SETTLED_RUN_READY_FD": "settled run: the pipe its child says it is ready on",
}
TEST_VARIABLES = "SETTLED_TEST_"


def unknown_variables(environ: Mapping[str, str], settings: Iterable[str]) -> dict[str, str | None]:
    """The ``SETTLED_*`` names in ``environ`` that no setting (``settings``: their field names)
    and nothing else reads (in any case, as the settings are read), each with the nearest
    valid name (None: none is near)."""
    known = {f"SETTLED_{name.upper()}" for name in settings} | set(OTHER_VARIABLES)
    found: dict[str, str | None] = {}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("SETTLED_") or upper in known:
            continue
        if upper.startswith(TEST_VARIABLES):
            continue
        near = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.6)
        found[name] = near[0] if near else None
    return found


def refuse_unknown_variables(environ: Mapping[str, str], settings: Iterable[str]) -> None:
    """Raise InvalidSetting (``unknown_setting``) naming every ``SETTLED_*`` variable of
    ``environ`` that nothing reads (``unknown_variables``), with the nearest valid name."""
    found = unknown_variables(environ, settings)
    if not found:
        return
    parts = [
        f"unknown setting {name}" + (f"; did you mean {near}?" if near else "")
        for name, near in found.items()
    ]
    raise InvalidSetting(
        " / ".join(parts) + ("" if all(found.values()) else " (docs/configuration.md lists them)"),
        code="unknown_setting",
        setting=next(iter(found)),
    )
