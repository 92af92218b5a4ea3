"""The run report: every state x compensation state x cancel flag, in both languages."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from outbox.errors import InvalidInput
from outbox.report import RunFacts, build_report, render, render_line
from outbox.report_lines import Compensation, Group, OpFacts, build_line
from outbox.report_text import MESSAGES
from outbox.states import ConfigFault, RejectReason, State

RESTORED = {"en": re.compile("restored", re.IGNORECASE), "zh": re.compile("已恢复")}
STOPPED_PENDING = {
    "en": "Stopped further processing, but the result of operation {op} ({kind}) is still "
    "pending confirmation.",
    "zh": "已停止继续处理，但操作 {op}（{kind}）的结果仍待确认。",
}
GROUP = {
    State.PLANNED: Group.NOT_DONE,
    State.SUBMITTED: Group.UNCERTAIN,
    State.UNKNOWN: Group.UNCERTAIN,
    State.SUCCEEDED: Group.DONE,
    State.REJECTED: Group.NOT_DONE,
    State.CANCELLED: Group.NOT_DONE,
}


def op(
    op_id: str,
    state: State,
    *,
    kind: str = "after_sales_ticket",
    compensates: str | None = None,
    reference: str | None = "auto",
    receipt_status: str | None = "auto",
    in_review: bool = False,
) -> OpFacts:
    """Facts as the store would give them: a receipt exactly when succeeded."""
    done = state is State.SUCCEEDED
    return OpFacts(
        op_id=op_id,
        kind=kind,
        state=state,
        reason=RejectReason.BUSINESS_REJECTED.value if state is State.REJECTED else None,
        code="declined" if state is State.REJECTED else None,
        reference=(f"ref_{op_id}" if done else None) if reference == "auto" else reference,
        receipt_status=("succeeded" if done else None)
        if receipt_status == "auto"
        else receipt_status,
        in_review=in_review,
        compensates=compensates,
    )


def run(*ops: OpFacts, cancelled: bool = False) -> RunFacts:
    return RunFacts(handle="run_x", cancelled=cancelled, operations=ops)


#: compensation variants: absent, or in a state with or without its receipt
COMPENSATIONS: list[tuple[State, bool] | None] = [
    None,
    *((s, False) for s in State),
    (State.SUCCEEDED, True),
]


def comp_facts(variant: tuple[State, bool]) -> OpFacts:
    state, with_receipt = variant
    if state is State.SUCCEEDED and not with_receipt:
        # recorded done, but no receipt: never "restored"
        return op("op-c", state, kind="ticket_cancel", compensates="op-1", reference=None,
                  receipt_status=None)  # fmt: skip
    return op("op-c", state, kind="ticket_cancel", compensates="op-1")


def expected_comp_status(variant: tuple[State, bool]) -> Compensation:
    state, with_receipt = variant
    if state is State.SUCCEEDED:
        return Compensation.RESTORED if with_receipt else Compensation.PENDING
    if state in (State.SUBMITTED, State.UNKNOWN):
        return Compensation.PENDING
    if state is State.PLANNED:
        return Compensation.NOT_SENT
    return Compensation.NOT_DONE


def section(text: str, lang: str, group: Group) -> str:
    """The lines of ``text`` under ``group``'s heading, up to the next heading."""
    headings = [MESSAGES[lang][f"heading.{g.value}"] for g in Group]
    out: list[str] = []
    inside = False
    for row in text.splitlines():
        if row in headings:
            inside = row == MESSAGES[lang][f"heading.{group.value}"]
        elif inside:
            out.append(row)
    return "\n".join(out)


CASES = list(itertools.product(State, COMPENSATIONS, [False, True], ["en", "zh"]))


@pytest.mark.parametrize(
    ("state", "comp", "cancelled", "lang"),
    CASES,
    ids=[f"{s.value}-{c[0].value + ('+r' if c[1] else '') if c else 'nocomp'}-"
         f"{'cancelled' if x else 'open'}-{lang}" for s, c, x, lang in CASES],
)  # fmt: skip
def test_every_state_compensation_and_cancel_flag_is_reported_truthfully(
    state: State, comp: tuple[State, bool] | None, cancelled: bool, lang: str
) -> None:
    ops = [op("op-1", state)]
    if comp is not None:
        ops.append(comp_facts(comp))
    report = build_report(run(*ops, cancelled=cancelled))
    line = report.line("op-1")
    assert line.group is GROUP[state]
    text = render(report, lang)  # type: ignore[arg-type]
    sentence = render_line(line, cancelled, lang)  # type: ignore[arg-type]
    assert sentence in text
    assert "op-1" in sentence
    # The line sits under the heading of its state's group, and under no other.
    for group in Group:
        assert (f"- {sentence}" in section(text, lang, group)) is (group is GROUP[state])

    restored = comp is not None and expected_comp_status(comp) is Compensation.RESTORED
    # Never "restored" without the compensation's receipt; always with it.
    assert bool(RESTORED[lang].search(text)) is restored
    if comp is None:
        assert line.compensation is None
    else:
        assert line.compensation is not None
        assert line.compensation.status is expected_comp_status(comp)
        assert "op-c" in sentence
        if restored:
            assert "ref_op-c" in sentence
            assert line.compensation.reference == "ref_op-c"
        else:
            assert line.compensation.reference is None
        comp_line = report.line("op-c")
        assert comp_line.compensates == "op-1"
        assert comp_line.group is GROUP[comp[0]]

    if state is State.SUCCEEDED:
        assert "ref_op-1" in sentence and line.evidence["reference"] == "ref_op-1"
    if state is State.REJECTED:
        assert line.evidence == {"reason": "business_rejected", "code": "declined",
                                 "in_review": False}  # fmt: skip
        assert "declined" in sentence
    stopped = STOPPED_PENDING[lang].format(op="op-1", kind="after_sales_ticket")
    assert (stopped in text) is (cancelled and state in (State.SUBMITTED, State.UNKNOWN))
    assert (MESSAGES[lang]["stopped"] in text) is cancelled

    data = report.as_dict(lang)
    json.dumps(data)  # JSON-safe
    assert [row["op_id"] for row in data[GROUP[state].value] if row["op_id"] == "op-1"]
    assert data["counts"][GROUP[state].value] >= 1
    assert sum(data["counts"].values()) == len(ops)


def test_issue_wording_for_a_stopped_run_in_both_languages() -> None:
    report = build_report(run(op("op-9", State.UNKNOWN, kind="refund"), cancelled=True))
    assert "Stopped further processing, but the result of operation op-9 (refund) is still " \
           "pending confirmation." in render(report, "en")  # fmt: skip
    assert "已停止继续处理，但操作 op-9（refund）的结果仍待确认" in render(report, "zh")


def test_succeeded_compensation_whose_receipt_says_rejected_is_not_restored() -> None:
    comp = op("op-c", State.SUCCEEDED, compensates="op-1", receipt_status="rejected")
    report = build_report(run(op("op-1", State.SUCCEEDED), comp))
    assert report.line("op-1").compensation is not None
    assert report.line("op-1").compensation.status is Compensation.PENDING  # type: ignore[union-attr]
    for lang in ("en", "zh"):
        assert not RESTORED[lang].search(render(report, lang))  # type: ignore[arg-type]


def test_best_of_several_compensations_is_cited() -> None:
    failed = op("op-c1", State.REJECTED, kind="ticket_cancel", compensates="op-1")
    good = op("op-c2", State.SUCCEEDED, kind="ticket_cancel", compensates="op-1")
    report = build_report(run(op("op-1", State.SUCCEEDED), failed, good))
    note = report.line("op-1").compensation
    assert note is not None
    assert (note.op_id, note.status, note.reference) == (
        "op-c2",
        Compensation.RESTORED,
        "ref_op-c2",
    )
    assert report.line("op-c1").group is Group.NOT_DONE


def test_operation_in_review_says_staff_are_checking() -> None:
    report = build_report(run(op("op-1", State.UNKNOWN, in_review=True)))
    assert "support staff are checking it" in render(report, "en")
    assert "客服人员正在核查" in render(report, "zh")
    assert report.line("op-1").evidence["in_review"] is True


def test_report_text_never_contains_receipt_params() -> None:
    # Only the reference is carried: a payee cannot reach the report.
    report = build_report(run(op("op-1", State.SUCCEEDED, kind="refund")))
    assert set(report.line("op-1").evidence) == {"reference", "in_review"}


def test_unsupported_language_is_a_typed_error() -> None:
    report = build_report(run(op("op-1", State.PLANNED)))
    with pytest.raises(InvalidInput) as err:
        report.as_dict("fr")
    assert err.value.code == "unsupported_language"


def test_every_message_exists_in_both_languages() -> None:
    assert set(MESSAGES["en"]) == set(MESSAGES["zh"])
    for key in MESSAGES["en"]:
        en, zh = (set(re.findall(r"{(\w+)}", MESSAGES[lang][key])) for lang in ("en", "zh"))
        assert en == zh, key


# -- "not sent" only when nothing was; a person's statement is reported as one -------------


def one_line(facts: OpFacts, lang: str = "en", *, cancelled: bool = False) -> str:
    report = build_report(RunFacts(handle="run_x", cancelled=cancelled, operations=[facts]))
    return render_line(report.lines[0], cancelled, lang)  # type: ignore[arg-type]


NOT_SENT = {"en": re.compile(r"\bsent\b"), "zh": re.compile("发送")}


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize(
    ("state", "reason", "cancelled"),
    [
        (State.REJECTED, RejectReason.NOT_EXECUTED.value, False),
        (State.CANCELLED, None, False),
        (State.PLANNED, None, False),
        (State.PLANNED, None, True),
    ],
)
def test_an_operation_that_was_sent_is_never_reported_as_not_sent(
    state: State, reason: str | None, cancelled: bool, lang: str
) -> None:
    never = OpFacts("op-9", "refund", state, reason=reason, sent=False)
    sent = OpFacts("op-9", "refund", state, reason=reason, sent=True)
    assert NOT_SENT[lang].search(one_line(never, lang, cancelled=cancelled))
    assert not NOT_SENT[lang].search(one_line(sent, lang, cancelled=cancelled))


def test_a_rejection_after_sends_says_it_was_not_carried_out() -> None:
    facts = OpFacts("op-9", "refund", State.REJECTED, reason="not_executed", sent=True)
    assert (
        one_line(facts) == "Operation op-9 (refund) was not done: it was not carried out in time."
    )
    assert one_line(facts, "zh") == "操作 op-9（refund）未完成：未能及时执行。"


FENCED = {"rests_on": "deadline_fence"}
BOUND = {"rests_on": "delay_bound", "max_request_delay_seconds": 300.0}


@pytest.mark.parametrize(
    ("assumed", "lang", "said"),
    [
        (
            FENCED,
            "en",
            "This rests on the service refusing any request that arrives past its deadline.",
        ),
        (BOUND, "en", "This assumes that no request reaches the service more than 5 min late."),
        (FENCED, "zh", "此结论的依据：对方服务拒绝超过截止时间才到达的请求。"),
        (BOUND, "zh", "此结论的前提：任何请求到达对方服务的延迟都不超过 5 分钟。"),
    ],
)
def test_a_not_done_proven_by_a_not_found_says_which_assumption_it_rests_on(
    assumed: dict[str, object], lang: str, said: str
) -> None:
    for facts in (
        OpFacts("op-9", "refund", State.REJECTED, reason="not_executed", sent=True, **assumed),  # type: ignore[arg-type]
        OpFacts("op-9", "refund", State.CANCELLED, sent=True, **assumed),  # type: ignore[arg-type]
        OpFacts("op-9", "refund", State.PLANNED, sent=True, **assumed),  # type: ignore[arg-type]
    ):
        assert one_line(facts, lang).endswith(said)
        assert one_line(facts, lang, cancelled=True).endswith(said)


def test_a_delay_bound_in_seconds_is_said_in_seconds() -> None:
    facts = OpFacts(
        "op-9", "refund", State.CANCELLED, sent=True, rests_on="delay_bound",
        max_request_delay_seconds=2.5,
    )  # fmt: skip
    assert one_line(facts).endswith("more than 2.5 s late.")


@pytest.mark.parametrize(
    "facts",
    [
        # a definite refusal proves itself: no assumption behind it
        OpFacts(
            "op-9",
            "refund",
            State.REJECTED,
            reason="business_rejected",
            sent=True,
            rests_on="delay_bound",
        ),
        # support staff's own statement is theirs, not a "not found"'s
        OpFacts(
            "op-9",
            "refund",
            State.REJECTED,
            reason="not_executed",
            sent=True,
            by_staff=True,
            rests_on="delay_bound",
        ),
        # done, or still uncertain: no "not done" to rest on anything
        OpFacts(
            "op-9", "refund", State.SUCCEEDED, reference="re_1", sent=True, rests_on="delay_bound"
        ),
        OpFacts("op-9", "refund", State.UNKNOWN, sent=True, rests_on="delay_bound"),
    ],
)
def test_only_a_not_done_for_want_of_a_refusal_names_an_assumption(facts: OpFacts) -> None:
    line = build_report(run(facts)).line("op-9")
    assert "rests_on" not in line.evidence
    for lang in ("en", "zh"):
        assert not re.search("rests on|assumes|依据|前提", one_line(facts, lang))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_staff_statement_is_reported_as_a_persons_statement_not_a_receipt(lang: str) -> None:
    done = OpFacts(
        "op-9", "refund", State.SUCCEEDED, reference="ref-typed", receipt_status="succeeded",
        sent=True, by_staff=True,
    )  # fmt: skip
    rejected = OpFacts(
        "op-9", "refund", State.REJECTED, reason="not_executed", sent=True, by_staff=True
    )
    word = {"en": "support staff", "zh": "客服人员"}[lang]
    for facts in (done, rejected):
        text = one_line(facts, lang)
        assert word in text
        assert not RESTORED[lang].search(text)
    assert "ref-typed" in one_line(done, lang)


def test_a_compensation_settled_by_staff_is_not_restored() -> None:
    original = OpFacts("op-1", "refund", State.SUCCEEDED, reference="re_1", sent=True)
    comp = OpFacts(
        "op-2", "refund", State.SUCCEEDED, reference="ref-typed", receipt_status="succeeded",
        compensates="op-1", sent=True, by_staff=True,
    )  # fmt: skip
    report = build_report(RunFacts(handle="run_x", cancelled=False, operations=[original, comp]))
    note = report.line("op-1").compensation
    assert note is not None and note.status is Compensation.STAFF
    text = render_line(report.line("op-1"), False, "en")
    assert not RESTORED["en"].search(text)
    assert "Support staff recorded compensation op-2 as done (reference ref-typed)" in text


@pytest.mark.parametrize("fault", list(ConfigFault))
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_fault_of_ours_is_the_stop_the_report_names(fault: ConfigFault, lang: str) -> None:
    reason = "permission_denied" if fault is ConfigFault.CREDENTIALS_REFUSED else "not_executed"
    facts = OpFacts("op-9", "refund", State.REJECTED, reason=reason, fault=fault.value)
    line = build_line(facts, cancelled=False)
    assert line.evidence["reason"] == fault.value
    assert MESSAGES[lang][f"reason.{fault.value}"] in render_line(line, False, lang)  # type: ignore[arg-type]
    not_in_time = MESSAGES[lang]["reason.not_executed"]
    assert not_in_time not in render_line(line, False, lang)  # type: ignore[arg-type]
    # Support staff's own statement stays theirs.
    by_staff = OpFacts(
        "op-9", "refund", State.REJECTED, reason=reason, fault=fault.value, by_staff=True
    )
    staff = build_line(by_staff, cancelled=False)
    assert staff.evidence["reason"] == reason


@pytest.mark.parametrize(
    ("minor", "currency", "written"),
    [(10000, "CNY", "100.00 CNY"), (5, "USD", "0.05 USD"), (500, "JPY", "500 JPY"),
     (1234, "KWD", "1.234 KWD")],
)  # fmt: skip
def test_a_line_names_the_amount_in_the_currencys_minor_units(
    minor: int, currency: str, written: str
) -> None:
    facts = OpFacts("op-9", "refund", State.SUCCEEDED, reference="re_1", receipt_status="succeeded",
                    amount_minor=minor, currency=currency)  # fmt: skip
    assert one_line(facts) == f"Operation op-9 (refund of {written}) is done (receipt re_1)."
    assert one_line(facts, "zh") == f"操作 op-9（refund，{written}）已完成（回执 re_1）。"
    line = build_report(run(facts)).lines[0].as_dict()
    assert (line["amount_minor"], line["currency"]) == (minor, currency)


@pytest.mark.parametrize("state", list(State))
def test_every_line_of_an_operation_with_an_amount_names_it(state: State) -> None:
    facts = OpFacts("op-9", "refund", state, amount_minor=10000, currency="CNY", sent=True)
    for lang, cancelled in itertools.product(("en", "zh"), (False, True)):
        assert "100.00 CNY" in one_line(facts, lang, cancelled=cancelled)


def test_a_kind_without_an_amount_is_named_alone() -> None:
    facts = OpFacts("op-t", "after_sales_ticket", State.PLANNED)
    assert one_line(facts) == "Operation op-t (after_sales_ticket) has not been sent yet."
