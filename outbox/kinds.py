"""Operation kinds: each declares a strict intent model, its downstream's contract, the
providers that can serve it, and what it means to an AI agent (its ``AgentProfile``)."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from outbox.currencies import MINOR_UNITS, format_amount
from outbox.errors import InvalidParams, UnknownKind
from outbox.retry import DEFAULT_CAP_SECONDS

#: Largest accepted amount in minor units (10^12 = ten billion in a 2-digit currency).
MAX_AMOUNT_MINOR = 10**12
#: Largest accepted params payload, as canonical JSON.
MAX_PARAMS_BYTES = 4096

Ref = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
AmountMinor = Annotated[int, Field(gt=0, le=MAX_AMOUNT_MINOR)]


def _known_currency(code: str) -> str:
    if code not in MINOR_UNITS:
        raise ValueError("not an active ISO 4217 currency code")
    return code


# Currency codes are rejected unless upper-case: "cny" is refused, never silently changed,
# so the fingerprint never depends on which spelling the caller happened to use.
Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$"), AfterValidator(_known_currency)]


def _calendar_day(day: str) -> str:
    # Only a day that prints back as itself: fromisoformat alone also takes "20240229" and
    # week dates, and "\d" in the pattern would have taken any script's digits.
    try:
        real = day.isascii() and date.fromisoformat(day).isoformat() == day
    except ValueError:
        real = False
    if not real:
        raise ValueError("not a calendar day (YYYY-MM-DD)")
    return day


# Kept as the string the caller sent (not a date): the canonical form, and so the fingerprint,
# of every intent valid before stays the same.
Day = Annotated[
    str,
    Field(pattern=r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
    AfterValidator(_calendar_day),
]


class Intent(BaseModel):
    """Base of every intent model: strict types, no extra fields, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RefundIntent(Intent):
    """Refund ``amount_minor`` (integer minor units of ``currency``) on an order to a payee."""

    order_id: Ref
    amount_minor: AmountMinor
    currency: Currency
    payee: Ref


#: an after-sales ticket's category (the MCP tool's ``problem``)
TicketProblem = Literal["damaged", "wrong_item", "not_as_described", "other"]
#: why a ticket is cancelled (the MCP compensation tool's ``cause``)
TicketCancelCause = Literal["pickup_failed", "customer_request", "duplicate"]


class TicketIntent(Intent):
    """Open an after-sales ticket (the app chooses ``ticket_id``)."""

    ticket_id: Ref
    order_id: Ref
    reason: TicketProblem


class PickupIntent(Intent):
    """Schedule the courier pickup for an after-sales ticket."""

    ticket_id: Ref
    day: Day
    slot: Literal["morning", "afternoon", "evening"]


class TicketCancelIntent(Intent):
    """Cancel an after-sales ticket (the compensation of ``after_sales_ticket``)."""

    ticket_id: Ref
    reason: TicketCancelCause


@dataclass(frozen=True)
class DownstreamContract:
    """What the downstream promises for one kind; decides what Settled may do automatically."""

    idempotent: bool = True  # replays with the same key return the first result
    queryable: bool = True  # a lookup by idempotency key exists
    key_retention: timedelta = timedelta(hours=24)  # how long the downstream remembers a key
    #: statuses documented as "refused before processing": safe to send again, same key
    not_executed_statuses: frozenset[int] = frozenset({429})
    #: longest from a request leaving Settled to its result being visible to lookups
    #: (network transit included)
    processing_time: timedelta = timedelta(seconds=2)
    #: automatic resends stop this long before the key retention ends: slack for the
    #: downstream's clock and for a lookup outage that ends near the edge
    retention_margin: timedelta = timedelta(hours=1)
    #: the downstream refuses, before any effect, a request that arrives after its
    #: ``Settled-Deadline`` (``408 deadline_exceeded``, docs/wire-protocol.md): a fence at the
    #: resource, so no request can land after its attempt's lease
    enforces_deadline: bool = False
    #: without that fence, the longest a request may take to land after its attempt ended:
    #: a client process stalled between its last check and its write (a GC or VM pause, a
    #: frozen container), the kernel retransmitting a request written in time (capped by the
    #: attempt's TCP_USER_TIMEOUT), a slow path or a proxy's queue. A "not found" proves
    #: nothing until it has passed (``reconciler.decide``). 5 minutes: far beyond the pauses
    #: and retransmissions seen in practice, short against the key retention (24 h)
    max_request_delay: timedelta = timedelta(minutes=5)
    #: the longest wait between two tries of a send that provably did not execute (refused
    #: connections, a documented 429 or 503): backoff doubles up to it, for as long as the
    #: operation's deadline allows (``outbox.retry``)
    retry_cap: timedelta = timedelta(seconds=DEFAULT_CAP_SECONDS)

    @property
    def rests_on(self) -> str:
        """What a "not found" from this downstream rests on: ``deadline_fence`` (it refuses
        late requests) or ``delay_bound`` (no request lands later than ``max_request_delay``)."""
        return "deadline_fence" if self.enforces_deadline else "delay_bound"

    def assumption(self) -> dict[str, Any]:
        """``rests_on`` as evidence, with the delay bound it assumes where it assumes one."""
        if self.enforces_deadline:
            return {"rests_on": self.rests_on}
        return {
            "rests_on": self.rests_on,
            "max_request_delay_seconds": self.max_request_delay.total_seconds(),
        }

    def resend_until(self, first_sent_at: datetime) -> datetime:
        """The last moment the first key may be sent again (and a "not found" trusted)."""
        return first_sent_at + self.key_retention - self.retention_margin


@dataclass(frozen=True)
class Compensation:
    """How an agent's request compensates an operation of a kind: the kind of the new
    operation, and its params from the original's params and the cause the agent gives."""

    kind: str
    params: Callable[[Mapping[str, Any], str], dict[str, Any]]


#: a placeholder of ``AgentProfile.prompt`` that is not an intent field: the amount in its
#: currency's units, with the currency (``100.00 CNY``), from ``amount_minor`` and ``currency``
MONEY = "money"


@dataclass(frozen=True)
class AgentProfile:
    """What a kind means to an AI agent: how the MCP tools (``settled mcp``) name and show a
    request of it, and the proposals' rules for it (``outbox.proposals``). Every field has a
    default, so a kind of the app's own needs none: its requests are then named by the kind's
    name and show every intent field."""

    #: what one request is called in the tools' sentences ("refund"; default: the kind's name)
    noun: str | None = None
    #: per language (``en``, ``zh``), a request's name in status answers ("Refund request";
    #: default: the kind's name)
    titles: Mapping[str, str] = field(default_factory=dict)
    #: the intent fields a status answer shows beside the handle, in order (default: all);
    #: an answer always names the order (the kind's ``order_field``)
    shown: tuple[str, ...] = ()
    #: intent fields shown under another name in answers, e.g. ``{"reason": "problem"}``
    shown_as: Mapping[str, str] = field(default_factory=dict)
    #: the intent's fields as the request tool calls them, for an error naming a field
    tool_fields: Mapping[str, str] = field(default_factory=dict)
    #: the intent field that names a new thing downstream: the server mints it (``mint``)
    #: when a request leaves it out (a model that chose it would choose a new one on every
    #: retry), and a repeat is then judged on the other fields
    minted: str | None = None
    #: what a minted value starts with (``tkt_``)
    minted_prefix: str = ""
    #: how a request compensates an operation of this kind (None: it cannot be)
    compensation: Compensation | None = None
    #: the read tool a model follows a request of this kind with
    status_tool: str = "request_status"
    #: the note on an answer that repeats an earlier request
    repeat_note: str = (
        "This repeats an earlier request: nothing new was made. Do not ask again; follow "
        "this handle with request_status."
    )
    #: the approval prompt's words for what a request would do, a template of intent fields
    #: (and ``{money}``), e.g. ``"a refund of {money} to payee {payee} on order {order_id}"``
    #: (default: the kind's name)
    prompt: str | None = None
    #: the same, short, for the earlier requests on the order a prompt lists (default: ``prompt``)
    prompt_short: str | None = None

    def noun_of(self, kind: str) -> str:
        return self.noun or kind

    def title(self, kind: str, lang: str) -> str:
        return self.titles.get(lang, kind)

    def mint(self) -> str:
        """A new value of the ``minted`` field (72 random bits after the prefix)."""
        return self.minted_prefix + secrets.token_urlsafe(12)

    def what(self, kind: str, params: Mapping[str, Any], *, short: bool = False) -> str:
        """What a request of ``kind`` with ``params`` would do, in a few words."""
        template = (self.prompt_short or self.prompt) if short else self.prompt
        if template is None:
            return kind
        money = format_amount(params.get("amount_minor"), params.get("currency"))
        return template.format_map({**params, MONEY: money})

    def fields_named(self) -> set[str]:
        """Every intent field this profile names (checked against the intent by ``Kind``)."""
        named = {*self.shown, *self.shown_as, *self.tool_fields}
        if self.minted is not None:
            named.add(self.minted)
        for template in (self.prompt, self.prompt_short):
            if template is not None:
                named |= {f for _, f, _, _ in string.Formatter().parse(template) if f}
        return named - {MONEY}


#: the ``order_field`` of a kind that declares none and whose intent has this field: the
#: field every kind's order was read from before kinds declared it
ORDER_ID = "order_id"


@dataclass(frozen=True)
class Kind:
    """An operation type. ``order_field`` is the intent field naming the order an operation
    is on (None: its operations are on no order): intake's per-order lock, the proposals'
    rules and the console's search by order read it. Left out, it is ``order_id`` where the
    intent has that field and None where not."""

    name: str
    intent: type[Intent]
    endpoint: str  # path of the downstream's submit call
    contract: DownstreamContract = field(default_factory=DownstreamContract)
    #: what it means to an AI agent (not hashed: a profile holds mappings)
    agent: AgentProfile = field(default_factory=AgentProfile, hash=False)
    #: the downstream providers that can serve it (``SETTLED_DOWNSTREAM_PROVIDERS``): ``http``,
    #: the wire protocol, serves every kind
    providers: frozenset[str] = frozenset({"http"})
    #: the intent field naming the order (see the class docstring)
    order_field: str | None = ORDER_ID

    def __post_init__(self) -> None:
        fields = self.intent.model_fields
        if self.order_field == ORDER_ID and ORDER_ID not in fields:
            object.__setattr__(self, "order_field", None)  # the default, on an intent without it
        elif self.order_field is not None and self.order_field not in fields:
            raise ValueError(
                f"kind {self.name!r} names the order field {self.order_field!r}, which its "
                f"intent {self.intent.__name__} does not have"
            )
        unknown = sorted(self.agent.fields_named() - set(self.intent.model_fields))
        if unknown:
            raise ValueError(
                f"the agent profile of kind {self.name!r} names fields its intent "
                f"{self.intent.__name__} does not have: {unknown}"
            )

    def order_of(self, params: Intent | Mapping[str, Any] | None) -> str | None:
        """The order an intent (or a stored operation's params) is on: its ``order_field``'s
        value; None for a kind without an order, or no string there."""
        if self.order_field is None or params is None:
            return None
        if isinstance(params, Mapping):
            value = params.get(self.order_field)
        else:
            value = getattr(params, self.order_field, None)
        return value if isinstance(value, str) else None

    def parse(self, params: object) -> Intent:
        """Validate ``params`` against the intent model; raise InvalidParams (no values echoed)."""
        if not isinstance(params, Mapping):
            raise InvalidParams("params must be a JSON object", code="params_not_object")
        try:
            size = len(json.dumps(params, allow_nan=False, default=_refuse).encode())
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidParams(
                "params must be plain JSON (no NaN, no non-JSON values)", code="params_not_json"
            ) from exc
        if size > MAX_PARAMS_BYTES:
            raise InvalidParams(
                f"params exceed {MAX_PARAMS_BYTES} bytes", code="params_too_large", size=size
            )
        try:
            return self.intent.model_validate(dict(params))
        except ValidationError as exc:
            errors = [
                {"field": ".".join(str(p) for p in err["loc"]), "error": err["type"]}
                for err in exc.errors(include_input=False, include_url=False)
            ]
            raise InvalidParams(
                f"params do not match the {self.name!r} intent", errors=errors
            ) from None


def _refuse(value: object) -> Any:
    raise TypeError(type(value).__name__)


class KindRegistry:
    """The operation kinds an app accepts, by name."""

    def __init__(self, kinds: Iterable[Kind] = ()) -> None:
        self._kinds: dict[str, Kind] = {}
        for kind in kinds:
            self.register(kind)

    def register(self, kind: Kind) -> None:
        if kind.name in self._kinds:
            raise ValueError(f"kind {kind.name!r} is already registered")
        self._kinds[kind.name] = kind

    def get(self, name: object) -> Kind:
        if not isinstance(name, str) or name not in self._kinds:
            raise UnknownKind(f"unknown operation kind; known: {sorted(self._kinds)}")
        return self._kinds[name]

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def order_fields(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each intent field that names an order, with the kinds whose order it is, sorted
        (hashable: the search statements are built once per value)."""
        by_field: dict[str, list[str]] = {}
        for name in self.names():
            found = self._kinds[name].order_field
            if found is not None:
                by_field.setdefault(found, []).append(name)
        return tuple((f, tuple(names)) for f, names in sorted(by_field.items()))

    def order_of(self, kind: str, params: Mapping[str, Any] | None) -> str | None:
        """The order a stored operation of ``kind`` is on (None: no order, or a kind this
        registry does not hold)."""
        found = self._kinds.get(kind)
        return found.order_of(params) if found is not None else None

    def with_contract(self, name: str, **changes: Any) -> KindRegistry:
        """A copy in which kind ``name`` has its contract changed (tests, demo, odd downstreams)."""
        kinds = dict(self._kinds)
        kind = kinds[name]
        kinds[name] = replace(kind, contract=replace(kind.contract, **changes))
        return KindRegistry(kinds.values())


def _cancel_ticket(done: Mapping[str, Any], cause: str) -> dict[str, Any]:
    return {"ticket_id": done["ticket_id"], "reason": cause}


REFUND_PROFILE = AgentProfile(
    noun="refund",
    titles={"en": "Refund request", "zh": "退款申请"},
    shown=("order_id", "amount_minor", "currency", "payee"),
    status_tool="refund_status",
    repeat_note="This repeats an earlier request for the same order, amount, currency and "
    "payee: no new refund was made. Do not ask again; follow this handle with refund_status.",
    prompt="a refund of {money} to payee {payee} on order {order_id}",
    prompt_short="{money} to {payee}",
)
TICKET_PROFILE = AgentProfile(
    noun="ticket",
    titles={"en": "Ticket request", "zh": "售后工单申请"},
    shown=("order_id", "ticket_id", "reason"),
    # the ticket's category is the tool's "problem" (the tool's "reason" is the why)
    shown_as={"reason": "problem"},
    tool_fields={"reason": "problem"},
    minted="ticket_id",
    minted_prefix="tkt_",
    compensation=Compensation("ticket_cancel", _cancel_ticket),
    repeat_note="This repeats an earlier ticket request for the same order and problem: no "
    "new ticket was made. Do not ask again; follow this handle with request_status.",
    prompt="an after-sales ticket ({reason}) on order {order_id}",
    prompt_short="an after-sales ticket ({reason})",
)
TICKET_CANCEL_PROFILE = AgentProfile(
    noun="compensation",
    titles={"en": "Compensation request", "zh": "补偿申请"},
    shown=("ticket_id", "reason"),
    tool_fields={"reason": "cause"},
    repeat_note="This repeats an earlier compensation request for the same operation: "
    "nothing new was made. Do not ask again; follow this handle with request_status.",
    prompt="cancelling ticket {ticket_id} ({reason})",
)


def default_registry() -> KindRegistry:
    """Refunds (served by the wire protocol, Stripe, WeChat Pay or Alipay), after-sales
    tickets, pickups and ticket cancellations, with their agent profiles."""
    return KindRegistry(
        [
            Kind(
                "refund",
                RefundIntent,
                "/v1/refunds",
                agent=REFUND_PROFILE,
                providers=frozenset({"http", "stripe", "wechatpay", "alipay"}),
                order_field="order_id",
            ),
            Kind(
                "after_sales_ticket",
                TicketIntent,
                "/v1/tickets",
                agent=TICKET_PROFILE,
                order_field="order_id",
            ),
            Kind("pickup", PickupIntent, "/v1/pickups", order_field=None),
            Kind(
                "ticket_cancel",
                TicketCancelIntent,
                "/v1/ticket_cancellations",
                agent=TICKET_CANCEL_PROFILE,
                order_field=None,
            ),
        ]
    )
