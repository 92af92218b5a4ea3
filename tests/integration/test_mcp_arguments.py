"""The agent tools' arguments are exactly as strict as the core: every value ``Outbox.enqueue``
refuses, a tool refuses, before anything is written, with the documented structured error
(``kind``, ``message``, ``field``), never the SDK's pydantic text; through the SDK's client.

Each bad value is also handed to the core (``Outbox.enqueue``), which must refuse it too:
the tools are not stricter than the core either, except where the core takes no such field.
"""

from __future__ import annotations

from typing import Any

import pytest
from mcp import Client

from outbox.errors import InvalidInput
from tests.support.agents import REFUND, Human, call, converse, operations, proposals, server
from tests.support.rig import Rig

TICKET = {"order_id": "A1042", "problem": "damaged", "reason": "the vase arrived broken"}
HANDLE = "prp_" + "x" * 32

#: (field, a value the core refuses): bool for an integer, numeric strings, floats, null,
#: lists, objects, out-of-range amounts, malformed ids and codes
BAD_REFUND = [
    ("amount_minor", True),
    ("amount_minor", False),
    ("amount_minor", "100"),
    ("amount_minor", "10000"),
    ("amount_minor", 100.5),
    ("amount_minor", 100.0),
    ("amount_minor", 1e30),
    ("amount_minor", 0),
    ("amount_minor", -5),
    ("amount_minor", 10**13),
    ("amount_minor", None),
    ("amount_minor", [10000]),
    ("amount_minor", {"value": 10000}),
    ("currency", "cny"),
    ("currency", "XXX"),
    ("currency", 156),
    ("currency", None),
    ("payee", 7),
    ("payee", ""),
    ("payee", "P 7"),
    ("payee", "P" * 65),
    ("order_id", 1042),
    ("order_id", "A1042\x00"),
    ("order_id", ["A1042"]),
]


def core_refuses(rig: Rig, params: dict[str, Any]) -> bool:
    """Whether ``Outbox.enqueue`` refuses ``params`` as a refund's (nothing is kept)."""
    with rig.sessions() as session:
        try:
            rig.outbox.enqueue(
                session, tenant="acme", op_id="op-core-check", kind="refund", params=params
            )
        except InvalidInput:
            return True
        finally:
            session.rollback()
    return False


def refused_plainly(got: dict[str, Any], field: str) -> dict[str, Any]:
    """The documented error, naming ``field``, with none of the SDK's words or the value."""
    error = got["error"]
    assert error["kind"] == "fixable" and error["field"] == field
    for sdk_text in ("validation error", "errors.pydantic.dev", "input_value", "Error executing"):
        assert sdk_text not in error["message"]
    return error


@pytest.mark.parametrize(("field", "value"), BAD_REFUND)
def test_a_refund_argument_the_core_refuses_is_refused_and_nothing_is_written(
    rig: Rig, field: str, value: Any
) -> None:
    params = {k: v for k, v in REFUND.items() if k != "reason"}
    assert core_refuses(rig, {**params, field: value})
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **{**REFUND, field: value}))

    # a policy that would approve anything: nothing but the arguments stands in the way
    converse(server(rig, limits={"acme": 10**12}), model, Human())
    refused_plainly(seen[0], field)
    assert proposals(rig) == [] and operations(rig) == []
    rig.judged_by_ledger = False


def test_true_and_a_numeric_string_never_become_auto_approved_refunds(rig: Rig) -> None:
    """The measured defect: ``true`` was a 0.01 CNY refund and ``"100"`` a 1.00 CNY one."""
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        for amount in (True, "100"):
            seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": amount}))

    converse(server(rig, limits={"acme": 50000}), model, Human())
    for got in seen:
        error = refused_plainly(got, "amount_minor")
        assert "integer" in error["message"]
    assert proposals(rig) == [] and operations(rig) == []
    rig.judged_by_ledger = False


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("request_refund", {k: v for k, v in REFUND.items() if k != "amount_minor"},
         "amount_minor"),
        ("request_refund", {k: v for k, v in REFUND.items() if k != "reason"}, "reason"),
        ("request_refund", {**REFUND, "reason": ""}, "reason"),
        ("request_refund", {**REFUND, "reason": "x" * 501}, "reason"),
        ("request_refund", {**REFUND, "call_id": "bad id"}, "call_id"),
        ("request_refund", {**REFUND, "call_id": 17}, "call_id"),
        ("request_after_sales_ticket", {**TICKET, "problem": "meh"}, "problem"),
        ("request_after_sales_ticket", {**TICKET, "problem": None}, "problem"),
        ("request_after_sales_ticket", {k: v for k, v in TICKET.items() if k != "order_id"},
         "order_id"),
        ("request_compensation", {"handle": 42, "reason": "r"}, "handle"),
        ("request_compensation", {"handle": HANDLE, "reason": "r", "cause": "bored"}, "cause"),
        ("refund_status", {"handle": 42}, "handle"),
        ("refund_status", {"handle": ["prp_x"]}, "handle"),
        ("refund_status", {}, "handle"),
        ("request_status", {"handle": HANDLE, "lang": "fr"}, "lang"),
        ("cancel_request", {"handle": None}, "handle"),
    ],
)  # fmt: skip
def test_every_argument_error_is_the_documented_structured_result(
    rig: Rig, tool: str, arguments: dict[str, Any], field: str
) -> None:
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, tool, **arguments))

    converse(server(rig, limits={"acme": 10**12}), model, Human())
    error = refused_plainly(seen[0], field)
    assert {"field": field} == {"field": error["errors"][0]["field"]}
    if field not in arguments:
        assert error["message"] == f"{field} is required. Call again with it."
    assert proposals(rig) == [] and operations(rig) == []
    rig.judged_by_ledger = False


@pytest.mark.parametrize("tool", ["request_refund", "request_after_sales_ticket"])
@pytest.mark.parametrize("extra", ["op_id", "amount", "ticket_id"])
def test_an_argument_a_tool_does_not_take_is_refused_naming_it(
    rig: Rig, tool: str, extra: str
) -> None:
    arguments = REFUND if tool == "request_refund" else TICKET
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, tool, **arguments, **{extra: "call_9"}))

    converse(server(rig, limits={"acme": 10**12}), model, Human())
    error = refused_plainly(seen[0], extra)
    assert "Call again without it" in error["message"]
    assert proposals(rig) == [] and operations(rig) == []
    rig.judged_by_ledger = False


def test_the_schemas_say_what_the_server_enforces(rig: Rig) -> None:
    """No op_id offered; no other argument taken; the core's lengths, patterns and bounds;
    an output schema for the structured answers; each tool's words speak of its own request."""
    tools: dict[str, Any] = {}

    async def model(client: Client) -> None:
        tools.update({t.name: t for t in (await client.list_tools()).tools})

    converse(server(rig), model)
    for tool in tools.values():
        schema = tool.input_schema
        assert "op_id" not in schema["properties"] and schema["additionalProperties"] is False
        assert tool.output_schema is not None
        assert {"handle", "status", "text"} <= set(tool.output_schema["properties"])
    refund = tools["request_refund"].input_schema["properties"]
    assert refund["amount_minor"]["type"] == "integer"
    assert refund["amount_minor"]["exclusiveMinimum"] == 0 and refund["amount_minor"]["maximum"]
    assert refund["currency"]["pattern"] == "^[A-Z]{3}$"
    assert refund["payee"]["pattern"] and refund["order_id"]["pattern"]
    assert refund["reason"]["minLength"] == 1 and refund["reason"]["maxLength"] == 500
    assert "pattern" in refund["call_id"]["anyOf"][0]
    ticket = tools["request_after_sales_ticket"]
    assert ticket.input_schema["properties"]["problem"]["enum"]
    assert tools["request_status"].input_schema["properties"]["lang"]["enum"] == ["en", "zh"]
    for name in ("request_after_sales_ticket", "request_compensation"):
        assert "the refund" not in (tools[name].description or "")
    rig.judged_by_ledger = False


def test_a_request_after_a_decline_tells_the_human_it_was_declined(rig: Rig) -> None:
    human = Human(("decline", None), ("decline", None))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **REFUND, call_id="c1"))
        seen.append(await call(client, "request_refund", **REFUND, call_id="c2"))

    converse(server(rig), model, human)
    assert [s["error"]["kind"] for s in seen] == ["business_rejected", "business_rejected"]
    assert "Declined before" not in human.prompts[0]
    assert (
        "Declined before on this order: 100.00 CNY to P-7 (declined by the user)."
        in (human.prompts[1])
    )
    assert [p.status for p in proposals(rig)] == ["declined", "declined"]
    assert operations(rig) == []
    rig.judged_by_ledger = False


def test_a_withdrawn_request_is_reported_as_withdrawn_and_so_in_the_next_prompt(
    rig: Rig,
) -> None:
    got: dict[str, Any] = {}

    async def agent(client: Client) -> None:  # a client that cannot ask: it waits for staff
        got["first"] = await call(client, "request_refund", **REFUND)
        handle = got["first"]["error"]["handle"]
        got["cancel"] = await call(client, "cancel_refund", handle=handle)
        got["zh"] = await call(client, "refund_status", handle=handle, lang="zh")

    converse(server(rig), agent)
    assert got["first"]["error"]["kind"] == "pending"
    assert got["cancel"]["status"] == "withdrawn" and "declined" not in got["cancel"]["text"]
    assert "撤回" in got["zh"]["text"]
    human = Human(("decline", None))

    async def again(client: Client) -> None:
        await call(client, "request_refund", **REFUND)

    converse(server(rig), again, human)
    assert "(withdrawn by the agent)" in human.prompts[0]
    rig.judged_by_ledger = False


def test_a_well_formed_call_id_is_kept_as_correlation(rig: Rig) -> None:
    async def model(client: Client) -> None:
        await call(client, "request_refund", **REFUND, call_id="toolu_01:A/b+c=")

    converse(server(rig, limits={"acme": 50000}), model)
    assert [p.correlation_id for p in proposals(rig)] == ["toolu_01:A/b+c="]
    rig.judged_by_ledger = False


def test_a_core_refusal_names_the_tools_field_not_the_cores() -> None:
    """The core checks ``correlation_id``; the model sent ``call_id``: the error says so."""
    from outbox.ids import validate_correlation_id
    from settled.mcp_desk import invalid
    from settled.mcp_requests import TOOL_NAMES

    with pytest.raises(InvalidInput) as refused:
        validate_correlation_id("bad id")
    got = invalid(refused.value, TOOL_NAMES).structured_content
    assert got is not None and got["error"]["field"] == "call_id"
    assert "correlation_id" not in got["error"]["message"]
