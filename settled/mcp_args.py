"""The agent tools' argument types: exactly as strict as the core (``outbox.kinds``,
``outbox.ids``, ``outbox.proposal_rules``), so a tool refuses every argument ``Outbox.enqueue``
and ``Proposals.propose`` refuse, before anything is written, and its input schema says so.

Strict: no bool for an integer (``true`` is not 1), no numeric string (``"100"`` is not 100),
no float (100.5, 1e30), no number for a string. The constraints (lengths, patterns, the
amount's bounds) are the core's own annotated types, so the schema and the core cannot drift
apart. A violation is a ``fixable`` error naming the field (``AgentServer.call_tool``), never
the SDK's text.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict

from outbox.ids import CORRELATION_ID_RE
from outbox.kinds import AmountMinor, Currency, Ref, TicketCancelCause, TicketProblem
from outbox.proposal_rules import HANDLE_RE, MAX_REASON

OrderId = Annotated[Ref, Strict(), Field(description="The shop's order id.")]
Payee = Annotated[Ref, Strict(), Field(description="Who receives the refund (the shop's id).")]
Amount = Annotated[
    AmountMinor,
    Strict(),
    Field(description="The amount in integer minor units of currency (10000 = 100.00 CNY)."),
]
CurrencyCode = Annotated[
    Currency, Strict(), Field(description="An active ISO 4217 code, upper case (CNY).")
]
Reason = Annotated[
    str,
    Strict(),
    Field(min_length=1, max_length=MAX_REASON, description="Why, in the user's words."),
]
CallId = Annotated[
    str,
    Strict(),
    Field(
        pattern=f"^{CORRELATION_ID_RE.pattern}$",
        description="Your tool-call id, stored for correlation only (never an op id).",
    ),
]
Handle = Annotated[
    str,
    Strict(),
    Field(
        pattern=f"^{HANDLE_RE.pattern}$",
        description="The handle a request tool answered with (prp_...).",
    ),
]
# a Literal is strict by itself ("en" is the string "en", nothing else)
Lang = Annotated[Literal["en", "zh"], Field(description="The answer's language.")]
Problem = Annotated[TicketProblem, Field(description="The ticket's category.")]
Cause = Annotated[TicketCancelCause, Field(description="Why the ticket is cancelled.")]
