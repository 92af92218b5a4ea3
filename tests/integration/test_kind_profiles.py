"""A kind of the app's own, with an agent profile: the proposals' rules and the MCP status
answers read it (its minted field, its compensation, its title and the fields it shows)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import anyio
import pytest
from mcp import Client
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import InvalidInput
from outbox.intake import Outbox
from outbox.kinds import AgentProfile, Compensation, Intent, Kind, KindRegistry, Ref
from outbox.models import Operation
from outbox.proposals import Proposals
from settled.mcp_server import AgentDesk, build_server


class ExchangeIntent(Intent):
    order_id: Ref
    exchange_id: Ref
    size: Literal["s", "m", "l"]


class ExchangeCancelIntent(Intent):
    exchange_id: Ref
    reason: Literal["customer_request", "duplicate"]


def _cancel(done: Mapping[str, Any], cause: str) -> dict[str, Any]:
    return {"exchange_id": done["exchange_id"], "reason": cause}


EXCHANGE = AgentProfile(
    noun="exchange",
    titles={"en": "Exchange request"},
    shown=("order_id", "exchange_id", "size"),
    shown_as={"size": "new_size"},
    minted="exchange_id",
    minted_prefix="exc_",
    compensation=Compensation("exchange_cancel", _cancel),
    prompt="an exchange for size {size} on order {order_id}",
)
KINDS = KindRegistry(
    [
        Kind("exchange", ExchangeIntent, "/v1/exchanges", agent=EXCHANGE),
        Kind("exchange_cancel", ExchangeCancelIntent, "/v1/exchange_cancellations"),
    ]
)


@pytest.fixture
def proposals(outbox: Outbox) -> Proposals:
    return Proposals(replace(outbox, registry=KINDS), timedelta(hours=1))


def _ask(proposals: Proposals, s: Session, size: str = "m") -> Any:
    params = {"order_id": "A1", "size": size}
    return proposals.propose(s, tenant="acme", kind="exchange", params=params, reason="too small")


def test_the_profile_s_minted_field_is_minted_and_a_repeat_is_judged_without_it(
    engine: Engine, proposals: Proposals
) -> None:
    with Session(engine) as s, s.begin():
        first = _ask(proposals, s)
        again = _ask(proposals, s)
        other = _ask(proposals, s, size="l")
        assert first.created and first.proposal.params["exchange_id"].startswith("exc_")
        assert not again.created and again.proposal.handle == first.proposal.handle
        minted = first.proposal.params["exchange_id"]
        assert other.created and other.proposal.params["exchange_id"] != minted


def test_the_profile_s_compensation_is_the_one_proposed(
    engine: Engine, proposals: Proposals
) -> None:
    with Session(engine) as s, s.begin():
        original = _ask(proposals, s).proposal
        approved = proposals.approve(s, "acme", original.handle, by="staff:mei")
        op_id, handle, exchange_id = approved.op_id, original.handle, original.params["exchange_id"]
    with Session(engine) as s, s.begin():  # the exchange was made downstream
        s.execute(update(Operation).where(Operation.op_id == op_id).values(state="succeeded"))
    with Session(engine) as s, s.begin():
        got = proposals.propose_compensation(
            s, tenant="acme", handle=handle, cause="duplicate", reason="asked twice"
        )
        comp = got.proposal
        assert (comp.kind, comp.params, comp.order_ref) == (
            "exchange_cancel",
            {"exchange_id": exchange_id, "reason": "duplicate"},
            "A1",
        )
        # a kind whose profile names no compensation cannot be compensated through a request
        with pytest.raises(InvalidInput) as refused:
            proposals.propose_compensation(
                s, tenant="acme", handle=comp.handle, cause="duplicate", reason="undo the undo"
            )
    assert refused.value.code == "not_compensable"


def test_the_status_tool_answers_in_the_profile_s_words(
    engine: Engine, proposals: Proposals
) -> None:
    with Session(engine) as s, s.begin():
        handle = _ask(proposals, s).proposal.handle
    desk = AgentDesk(sessionmaker(engine), proposals, {}, tenant="acme")
    answers: list[dict[str, Any]] = []

    async def main() -> None:
        async with Client(build_server(desk)) as client:
            result = await client.call_tool("request_status", {"handle": handle})
            assert isinstance(result.structured_content, dict)
            answers.append(result.structured_content)

    anyio.run(main)
    (status,) = answers
    assert list(status)[:5] == ["handle", "kind", "order_id", "exchange_id", "new_size"]
    assert status["new_size"] == "m" and status["status"] == "waiting_for_approval"
    assert status["text"] == (
        f"Exchange request {handle} is waiting for approval; nothing has been sent."
    )
