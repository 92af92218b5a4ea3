"""The words of an item or operation page: the timeline's folding (``support.timeline``),
the lead sentence and the timeline lines in en and zh (``settled.console.story``), and the
times and raw JSON the pages show (``settled.console.formats``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from markupsafe import Markup

from settled.console.formats import ago, exact, iso_z, raw, when
from settled.console.story import lead, line
from settled.console.text import translate, word
from support.timeline import timeline

T0 = datetime(2026, 12, 3, 6, 0, 0, 123456, tzinfo=UTC)


def event(
    seconds: int, before: str | None, after: str, actor: str = "reconciler:r1",
    reason: str | None = None, **evidence: Any,
) -> dict[str, Any]:  # fmt: skip
    at = (T0 + timedelta(seconds=seconds)).isoformat()
    return {"at": at, "from": before, "to": after, "actor": actor, "reason": reason,
            "evidence": evidence or None}  # fmt: skip


UNAVAILABLE = {"lookup": "unavailable", "detail": "lookup answered HTTP 503",
               "review": "lookup_unavailable"}  # fmt: skip


def history(looks: int) -> list[dict[str, Any]]:
    """Created, sent, lost, put in review, then ``looks`` passes that find nothing new."""
    return [
        event(0, None, "planned", "intake"),
        event(1, "planned", "submitted", "w1", attempt=1),
        event(3, "submitted", "unknown", "w1", detail="ReadTimeout", status=None),
        event(4, "unknown", "unknown", reason="to_review", **UNAVAILABLE),
        *[event(60 * (n + 1), "unknown", "unknown", reason="in_review", **UNAVAILABLE)
          for n in range(looks)],
    ]  # fmt: skip


def test_consecutive_identical_looks_fold_into_one_entry_with_their_count() -> None:
    entries = timeline(history(14))
    assert [e["what"] for e in entries] == ["created", "sent", "no_answer", "look", "look"]
    folded = entries[-1]
    assert folded["count"] == 14 and folded["reason"] == "in_review"
    assert folded["at"] == (T0 + timedelta(seconds=60)).isoformat()  # the first look's time
    assert folded["last_at"] == (T0 + timedelta(seconds=840)).isoformat()  # the last's
    assert entries[3]["count"] == 1  # "put in review" is its own line: it decided something


def test_a_look_that_says_something_new_is_not_folded() -> None:
    events = [
        *history(2),
        event(200, "unknown", "unknown", reason="in_review", lookup="pending",
              review="lookup_unavailable"),
        event(300, "unknown", "unknown", reason="in_review", **UNAVAILABLE),
        event(301, "unknown", "unknown", "staff:ann", "staff_requery", lookup="unavailable",
              role="support"),
        event(302, "unknown", "unknown", "staff:ann", "staff_requery", lookup="unavailable",
              role="support"),
    ]  # fmt: skip
    entries = timeline(events)
    assert [(e["what"], e["count"]) for e in entries[4:]] == [
        ("look", 2), ("look", 1), ("look", 1), ("staff_requery", 1), ("staff_requery", 1)
    ]  # fmt: skip


def test_events_are_named_by_what_happened() -> None:
    events = [
        event(0, "unknown", "succeeded", "staff:ann", lookup="found", role="support"),
        event(1, "unknown", "rejected", "staff:bob", justification="x", override=True),
        event(1, "unknown", "succeeded", "staff:bob", lookup="found", review_item=3),
        event(2, "unknown", "planned", lookup="not_found"),
        event(3, "submitted", "rejected", "w1", "business_rejected"),
        event(4, "planned", "cancelled", "app"),
        event(5, "unknown", "unknown", "staff:ann", "staff_refused", action="resolve",
              code="contradicts_downstream", role="support"),
    ]  # fmt: skip
    assert [e["what"] for e in timeline(events)] == [
        "found", "resolved", "resolved", "requeued", "refused", "cancelled", "staff_refused"
    ]  # fmt: skip


def shown(state: str = "unknown", *, choices: list[dict[str, Any]] | None = None,
          params: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "operation": {
            "op_id": "op-1", "kind": "refund", "state": state, "reason": None, "attempts": 1,
            "downstream_ref": None,
            "params": params or {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY",
                                 "payee": "P-7"},
        },
        "item": {"resolved_at": None, "resolved_by": None},
        "last_lookup": None,
        "choices": choices if choices is not None else [
            {"outcome": "succeeded", "override": False}, {"outcome": "rejected", "override": False}
        ],
        **more,
    }  # fmt: skip


def test_the_lead_sentence_says_what_was_asked_what_is_known_and_what_to_do() -> None:
    assert lead("en", shown(), acting=True, page="item") == (
        "Refund of 100.00 CNY to payee P-7 for order A1042: the payment service's answer is "
        "unknown; check with the payment service and resolve below."
    )
    assert lead("zh", shown(), acting=True, page="item") == (
        "订单 A1042 向收款方 P-7 退款 100.00 CNY：支付服务的回答未知；"
        "请向支付服务核实，并在下方处理。"
    )


@pytest.mark.parametrize(
    ("page", "acting", "facts", "ends"),
    [
        ("item", False, {}, "; you may read it; support staff resolve it."),
        ("item", True, {"choices": [], "last_lookup": "unavailable"},
         " (the lookup was unavailable); look it up again now, or ask a supervisor."),
        ("item", True, {"choices": [{"outcome": "succeeded", "override": False}],
                        "last_lookup": "mismatch"},
         "allows one answer: resolve it as succeeded below."),
        ("item", True, {"choices": [{"outcome": "succeeded", "override": True},
                                    {"outcome": "rejected", "override": True}]},
         "as a supervisor you may resolve it below with a justification."),
        ("operation", False, {"review_item": 12}, "support staff resolve it in review item #12."),
        ("operation", False, {"review_item": None}, "the reconciler keeps looking it up; nothing "
                                                    "to do yet."),
    ],
)  # fmt: skip
def test_what_the_viewer_can_do_follows_the_page_the_role_and_the_choices(
    page: str, acting: bool, facts: dict[str, Any], ends: str
) -> None:
    assert lead("en", shown(**facts), acting=acting, page=page).endswith(ends)


def test_the_lead_of_a_settled_operation_names_its_reference_and_of_a_refusal_its_reason() -> None:
    done = shown("succeeded")
    done["operation"]["downstream_ref"] = "re_9f3a"
    assert lead("en", done, acting=False, page="operation") == (
        "Refund of 100.00 CNY to payee P-7 for order A1042: it is done (the payment service "
        "holds it as re_9f3a); nothing is left to do."
    )
    refused = shown("rejected")
    refused["operation"]["reason"] = "invalid_params"
    assert ": it was not done: the request was invalid;" in lead(
        "en", refused, acting=False, page="operation"
    )
    assert "未完成：请求参数无效" in lead("zh", refused, acting=False, page="operation")


def test_a_kind_without_the_facts_its_sentence_needs_is_named_plainly() -> None:
    odd = shown(params={"order_id": "A9"})
    assert lead("en", odd, acting=False, page="operation").startswith("refund op-1 for order A9:")


def test_timeline_lines_in_words_en_and_zh() -> None:
    entries = timeline(history(5))
    assert [line("en", e, "refund") for e in entries] == [
        "Asked for by intake: planned",
        "Attempt 1 sent by w1",
        "No answer to the attempt (the answer timed out): the outcome is unknown",
        "reconciler:r1 looked it up: the lookup was unavailable (lookup answered HTTP 503); put "
        "in review: the lookup stayed unavailable too long",
        "reconciler:r1 looked it up 5 times, nothing new: the lookup was unavailable (lookup "
        "answered HTTP 503); still in review",
    ]
    assert line("zh", entries[-1], "refund") == (
        "reconciler:r1 查询 5 次，无新情况：查询服务不可用（lookup answered HTTP 503）；仍在待处理"
    )


def test_a_code_without_words_is_shown_as_it_is() -> None:
    (entry,) = timeline([event(0, "unknown", "unknown", reason="brand_new_note", lookup="odd")])
    assert line("en", entry, "refund") == "reconciler:r1 looked it up: odd; brand_new_note"
    assert word("zh", "tl.lookup", "odd") == "odd"
    assert word("zh", "tl.lookup", "unavailable") == "查询服务不可用"


def test_times_are_relative_with_the_exact_utc_time_and_no_microseconds() -> None:
    now = T0 + timedelta(minutes=3, seconds=20)
    assert ago(T0, now) == "3 min ago" and ago(T0, now, "zh") == "3 分钟前"
    assert ago(T0, T0 + timedelta(seconds=4)) == "just now"
    assert ago(T0 + timedelta(hours=2), T0) == "in 2 h" and ago(T0, T0 + timedelta(days=3)) == (
        "3 d ago"
    )
    assert iso_z(T0.isoformat()) == "2026-12-03T06:00:00Z"
    assert exact(T0.astimezone(UTC).replace(tzinfo=None)) == "2026-12-03 06:00:00 UTC"
    tag = when(T0.isoformat(), now)
    assert tag == Markup(
        '<time datetime="2026-12-03T06:00:00Z" title="2026-12-03 06:00:00 UTC">3 min ago</time>'
    )
    assert when(None, now) == ""


def test_raw_json_cuts_timestamps_to_the_second() -> None:
    text = raw({"at": T0.isoformat(), "nested": [{"started_at": "2026-12-03T06:14:14.028587"}],
                "note": "2026-12-03 is not a timestamp"})  # fmt: skip
    assert '"at": "2026-12-03T06:00:00Z"' in text and '"started_at": "2026-12-03T06:14:14Z"' in text
    assert ".123456" not in text and "028587" not in text
    assert '"note": "2026-12-03 is not a timestamp"' in text


def test_a_markup_value_is_kept_and_the_others_escaped() -> None:
    tag = Markup('<time datetime="x">now</time>')
    text = translate("en", "item.resolved", by="<b>ann</b>", at=tag)
    assert text == 'Resolved by &lt;b&gt;ann&lt;/b&gt; at <time datetime="x">now</time>.'
