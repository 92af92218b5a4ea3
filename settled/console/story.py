"""The console's words for one operation: the sentence an item or operation page leads with
(what was asked, what is known, what the viewer can do) and one line per timeline entry
(``support.timeline``). Pure, over what the services returned; every word is a text key
(``settled.console.text``), and a code with no words of its own is shown as it is.
"""

from __future__ import annotations

from typing import Any

from outbox.currencies import format_amount
from settled.console.formats import exact, who
from settled.console.text import translate, word

#: states after which nothing is left to do
_TERMINAL = {"succeeded", "rejected", "cancelled"}


def lead(lang: str, shown: dict[str, Any], *, acting: bool, page: str) -> str:
    """The sentence a page leads with: ``page`` is "item" (a review item: what the viewer
    can do there) or "operation"."""
    op = shown["operation"]
    service = word(lang, "lead.service", op["kind"], fallback="lead.service.other")
    asked = _asked(lang, op)
    known = _known(lang, op, shown.get("last_lookup"), service)
    if page == "item":
        can = _can_on_item(lang, shown, acting=acting, service=service)
    else:
        due = (shown.get("report") or {}).get("due")
        can = _can_on_operation(lang, op, shown.get("review_item"), due)
    return translate(lang, "lead.sentence", asked=asked, known=known, can=can)


def _asked(lang: str, op: dict[str, Any]) -> str:
    params = op["params"] if isinstance(op["params"], dict) else {}
    values = {
        "amount": format_amount(params.get("amount_minor"), params.get("currency")),
        "payee": params.get("payee"),
        "order": params.get("order_id"),
        "ticket": params.get("ticket_id"),
        "problem": params.get("reason"),
        "op_id": op["op_id"],
        "kind": op["kind"],
    }
    key = f"lead.asked.{op['kind']}"
    needs = _NEEDS.get(op["kind"], ())
    if translate(lang, key) == key or not all(values[n] for n in needs):
        key = "lead.asked.order" if values["order"] else "lead.asked.other"
    return translate(lang, key, **values)


#: the facts each kind's "what was asked" names: without one of them, the plain form
_NEEDS: dict[str, tuple[str, ...]] = {
    "refund": ("amount", "payee", "order"),
    "ticket": ("problem", "order"),
    "ticket_cancel": ("ticket",),
}


def _known(lang: str, op: dict[str, Any], lookup: str | None, service: str) -> str:
    state = op["state"]
    if state == "planned":
        key = "lead.known.planned" if not op.get("attempts") else "lead.known.planned_again"
        return translate(lang, key, service=service)
    if state == "unknown":
        known = translate(lang, "lead.known.unknown", service=service)
        if lookup is not None:
            said = word(lang, "tl.lookup", lookup)
            known = translate(lang, "lead.known.unknown_lookup", known=known, lookup=said)
        return known
    if state == "rejected":
        why = _say(lang, "tl.reject", op.get("reason"), "tl.reject.other")
        return translate(lang, "lead.known.rejected", why=why)
    if state == "succeeded" and op.get("downstream_ref"):
        ref = op["downstream_ref"]
        return translate(lang, "lead.known.succeeded_ref", service=service, reference=ref)
    return translate(lang, f"lead.known.{state}", service=service)


def _can_on_item(lang: str, shown: dict[str, Any], *, acting: bool, service: str) -> str:
    item = shown["item"]
    if item.get("resolved_at"):
        return translate(lang, "lead.can.resolved", by=who(item.get("resolved_by")))
    if not acting:
        return translate(lang, "lead.can.read_only")
    choices = shown.get("choices") or []
    if not choices:
        key = "lead.can.wait_pending" if shown.get("last_lookup") == "pending" else "lead.can.none"
        return translate(lang, key)
    plain = [c["outcome"] for c in choices if not c["override"]]
    if not plain:
        return translate(lang, "lead.can.override")
    if len(plain) == 1 and len(choices) == 1:
        state = word(lang, "state", plain[0])
        return translate(lang, "lead.can.only", state=state)
    return translate(lang, "lead.can.check", service=service)


def _can_on_operation(
    lang: str, op: dict[str, Any], review_item: int | None, due: dict[str, Any] | None
) -> str:
    """What is left, and for an uncertain operation what it waits for and the latest it is
    decided by (``due``, ``outbox.verdict_due``; None: not said)."""
    if op["state"] in _TERMINAL:
        return translate(lang, "lead.can.nothing")
    if review_item is not None:
        key = "lead.can.in_review_staff" if due is not None else "lead.can.in_review"
        return translate(lang, key, id=review_item)
    if due is not None and due.get("verdict_by"):
        waits = word(lang, "lead.waits", due["waits_for"])
        return translate(lang, "lead.can.verdict_by", waits=waits, by=exact(due["verdict_by"]))
    if op["state"] == "unknown":
        return translate(lang, "lead.can.reconciling")
    return translate(lang, "lead.can.automatic")


def line(lang: str, entry: dict[str, Any], kind: str) -> str:
    """One timeline entry in words (``kind``: the operation's, for the service's name)."""
    service = word(lang, "lead.service", kind, fallback="lead.service.other")
    what = entry["what"]
    values: dict[str, Any] = {
        "actor": who(entry["actor"]),
        "service": service,
        "n": entry["attempt"] if entry["attempt"] is not None else "?",
        "count": entry["count"],
        "state": word(lang, "state", entry["to"]),
        "from": word(lang, "state", entry["from"] or ""),
        "reference": entry["reference"] or "",
        "role": entry["role"] or "",
    }
    values["detail"] = _detail(lang, entry)
    values["lookup"] = _say(lang, "tl.lookup", entry["lookup"], "tl.lookup.no")
    values["why"] = _say(lang, "tl.reject", entry["reason"], "tl.reject.other")
    values["decision"] = _decision(lang, entry)
    values["action"] = word(lang, "tl.action", entry["action"] or "")
    values["code"] = word(lang, "tl.code", entry["code"] or "")
    if what == "look" and entry["count"] > 1:
        what = "looks"
    if what == "look" and entry["lookup"] is None:
        what = "pass"  # a pass that asked nothing (or failed): its decision says why
    text = translate(lang, f"tl.{what}", **values)
    if entry["reference"] and what in ("accepted", "found", "resolved"):
        text += translate(lang, "tl.with_reference", reference=entry["reference"])
    if entry["override"]:
        text += translate(lang, "tl.override")
    return text


def _detail(lang: str, entry: dict[str, Any]) -> str:
    """What came back, in words where known: ``(the answer timed out)``; empty: nothing."""
    parts = []
    if entry["detail"]:
        parts.append(word(lang, "tl.detail", entry["detail"]))
    if entry["status"] is not None:
        parts.append(f"HTTP {entry['status']}")
    return translate(lang, "tl.paren", text=", ".join(parts)) if parts else ""


def _decision(lang: str, entry: dict[str, Any]) -> str:
    reason = entry["reason"] or ""
    if reason == "to_review":
        why = word(lang, "tl.review", entry["review"] or "")
        return translate(lang, "tl.decision.to_review", why=why)
    return _say(lang, "tl.decision", reason, "tl.decision.other")


def _say(lang: str, prefix: str, code: str | None, empty: str) -> str:
    """The words for ``code``: the ``empty`` key's where there is none, the code itself where
    it has no words."""
    return word(lang, prefix, code) if code else translate(lang, empty)
