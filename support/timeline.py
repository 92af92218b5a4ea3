"""An operation's history as staff read it: one entry per thing that happened, in order.

Pure, over the event rows ``support.operation_view`` reads (JSON-safe dicts). Each entry
names what happened (``what``: a send, its answer, a lookup and what it found, a decision,
a staff action) and carries the facts its sentence needs; the words are the console's
(``settled.console.story``). A reconcile pass that changes nothing writes an event too, so
a long wait fills the history with the same look again and again: consecutive looks that
say the same thing (same actor, decision, lookup answer and detail) are folded into one
entry with their ``count`` and the time of the first and the last.
"""

from __future__ import annotations

from typing import Any

#: what an event is, by its states: (from, to) -> what happened
_MOVES: dict[tuple[str | None, str], str] = {
    ("planned", "submitted"): "sent",
    ("submitted", "succeeded"): "accepted",
    ("submitted", "rejected"): "refused",
    ("submitted", "unknown"): "no_answer",
    ("submitted", "planned"): "not_sent",
    ("planned", "rejected"): "gave_up",
    ("planned", "cancelled"): "cancelled",
    ("unknown", "planned"): "requeued",
}

#: staff actions that change no state, by the note they write
_STAFF_NOTES = {"staff_requery", "staff_refused", "staff_confirmed"}


def timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of ``events`` (oldest first), consecutive identical looks folded."""
    entries: list[dict[str, Any]] = []
    for event in events:
        entry = _entry(event)
        last = entries[-1] if entries else None
        if last is not None and entry["what"] == "look" and _same_look(last, entry):
            last["count"] += 1
            last["last_at"] = entry["at"]
            last["evidence"] = entry["evidence"]  # the latest, in full, behind "details"
            continue
        entries.append(entry)
    return entries


def _entry(event: dict[str, Any]) -> dict[str, Any]:
    evidence = event.get("evidence") or {}
    actor = str(event.get("actor") or "")
    staff = actor.startswith("staff:")
    return {
        "what": _what(event, staff=staff),
        "at": event["at"],
        "last_at": None,  # the last of a folded run of looks
        "count": 1,
        "actor": actor,
        "staff": staff,
        "from": event.get("from"),
        "to": event["to"],
        # the event's reason: a reject reason, a look's decision, a staff note
        "reason": event.get("reason"),
        "lookup": _text(evidence.get("lookup")),
        "detail": _text(evidence.get("detail")) or _text(evidence.get("error")),
        "status": evidence.get("status") if isinstance(evidence.get("status"), int) else None,
        "reference": _reference(evidence),
        "attempt": evidence.get("attempt") if isinstance(evidence.get("attempt"), int) else None,
        "review": _text(evidence.get("review")),
        # a staff action's: the action refused, its code, the role, the state confirmed
        "action": _text(evidence.get("action")),
        "code": _text(evidence.get("code")),
        "role": _text(evidence.get("role")),
        "override": evidence.get("override") is True,
        "evidence": event.get("evidence"),
    }


def _what(event: dict[str, Any], *, staff: bool) -> str:
    before, after = event.get("from"), event["to"]
    reason = event.get("reason")
    if before is None:
        return "created"
    if before == after:
        if staff and reason in _STAFF_NOTES:
            return str(reason)
        return "look"  # a pass (or a note) that changed no state
    if before == "unknown" and after in ("succeeded", "rejected"):
        evidence = event.get("evidence") or {}
        if "review_item" in evidence or evidence.get("lookup") != "found":
            return "resolved"  # a staff resolution (weighed against a lookup, found or not)
        return "found"
    if before == "submitted" and after in ("succeeded", "rejected") and _found(event):
        return "found"  # a lookup found what a lost worker's send did
    return _MOVES.get((before, after), "moved")


def _found(event: dict[str, Any]) -> bool:
    return (event.get("evidence") or {}).get("lookup") == "found"


def _same_look(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two looks that tell staff nothing new one after the other."""
    keys = ("what", "actor", "from", "to", "reason", "lookup", "detail", "review", "reference")
    return all(a[k] == b[k] for k in keys)


def _reference(evidence: dict[str, Any]) -> str | None:
    record = evidence.get("record")
    if isinstance(record, dict) and isinstance(record.get("reference"), str):
        return str(record["reference"])
    return _text(evidence.get("reference"))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
