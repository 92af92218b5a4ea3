"""The console's pages: the review queue, an item (requery, resolve), find, one operation,
the overview, and what AI agents proposed (approve, decline). Server-rendered with Jinja2
(autoescaped); every page needs a signed-in member of staff (``auth.current_user``) and
every form POST its CSRF token (``auth.require_csrf``).

The rules live in the services (``support.review``, ``support.find``,
``support.overview``, ``support.approvals``), the same ones the CLI uses: a page only
shows what they return and the choices they allow, and a refused action is the service's
refusal. A lost race or a contradiction is a message on the item's page; a viewer's action
is a 403 page; another tenant's item, operation or proposal is a 404 page, like a missing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, pass_context
from jinja2.runtime import Context

from outbox.errors import (
    Forbidden,
    InvalidInput,
    NotFound,
    ProposalConflict,
    ReviewConflict,
    SettledError,
)
from outbox.proposals import Proposals
from settled.console import formats, story
from settled.console.auth import ConsoleUser, current_user, polled_user, require_csrf
from settled.console.chart import FRAME, chart
from settled.console.text import LANGS, lang_of, named, translate
from settled.runtime import Runtime
from support.approvals import Approvals
from support.find import KEYS, Finder
from support.overview import Overview
from support.review import ReviewQueue
from support.staff import ACTING, REASONS

HERE = Path(__file__).parent
PAGE_SIZE = 25


@dataclass(frozen=True)
class ConsoleServices:
    """What the pages use: the services the composition root built (``settled.runtime``), the
    same the worker and ``settled review`` use (each on first use: the review queue needs a
    gateway to the downstream). ``review`` and ``proposals`` replace the runtime's."""

    runtime: Runtime
    given_review: ReviewQueue | None = None
    given_proposals: Proposals | None = None

    @property
    def review(self) -> ReviewQueue:
        return self.given_review if self.given_review is not None else self.runtime.review

    @property
    def finder(self) -> Finder:
        return self.runtime.finder

    @property
    def overview(self) -> Overview:
        return self.runtime.overview

    @property
    def approvals(self) -> Approvals:
        if self.given_proposals is not None:
            return self.runtime.approvals_over(self.given_proposals)
        return self.runtime.approvals


templates = Jinja2Templates(
    env=Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True)
)
templates.env.globals.update(amount=formats.amount, who=formats.who, langs=LANGS)
templates.env.globals.update(lead=story.lead, line=story.line, raw=formats.raw)


@pass_context
def _state_name(context: Context, state: str | None) -> str:
    """``{{ op.state|state_name }}``: a state's name in the page's language."""
    return named(str(context.get("lang", "en")), "state", state)


@pass_context
def _reason_name(context: Context, reason: str | None) -> str:
    """``{{ item.reason|reason_name }}``: why an item is in review, in plain words."""
    return named(str(context.get("lang", "en")), "reason", reason)


@pass_context
def _reject_name(context: Context, reason: str | None) -> str:
    """``{{ op.reason|reject_name }}``: a rejected operation's reason, in plain words."""
    return named(str(context.get("lang", "en")), "reject", reason)


@pass_context
def _lookup_name(context: Context, answer: str | None) -> str:
    """``{{ shown.last_lookup|lookup_name }}``: what a lookup answered, in plain words."""
    return named(str(context.get("lang", "en")), "tl.lookup", answer)


templates.env.filters.update(
    state_name=_state_name,
    reason_name=_reason_name,
    reject_name=_reject_name,
    lookup_name=_lookup_name,
)

router = APIRouter(prefix="/console", include_in_schema=False)
User = Annotated[ConsoleUser, Depends(current_user)]
#: what a page polls by itself (``auth.polled_user``): signed in, the session not marked seen
Polled = Annotated[ConsoleUser, Depends(polled_user)]
Csrf = [Depends(require_csrf)]


def _services(request: Request) -> ConsoleServices:
    services: ConsoleServices = request.app.state.console
    return services


def _lang(request: Request) -> str:
    return lang_of(request.query_params.get("lang"), request.cookies.get("lang"))


def render(
    request: Request, user: ConsoleUser | None, name: str, *, status: int = 200, **context: Any
) -> Response:
    """Page ``name`` in the request's language; a ``lang`` query parameter is kept in a
    cookie, so the switch in the header holds for the next pages."""
    lang = _lang(request)
    now = datetime.now(UTC)
    response = templates.TemplateResponse(
        request,
        name,
        {
            "user": user,
            "lang": lang,
            "t": partial(translate, lang),
            "age": lambda since: formats.age(since, now),
            "when": lambda at, precise=False: formats.when(at, now, lang, precise=precise),
            "acting": user is not None and user.staff.role in ACTING,
            "refresh": _refresh_seconds(request),
            **context,
        },
        status_code=status,
    )
    if request.query_params.get("lang") in LANGS:
        response.set_cookie("lang", lang, httponly=True, samesite="lax", path="/console")
    return response


def _refresh_seconds(request: Request) -> str:
    """How often the queue and an item's status poll (``SETTLED_CONSOLE_REFRESH_SECONDS``),
    as htmx's ``every`` wants it."""
    seconds = float(_services(request).runtime.settings.console_refresh_seconds)
    return f"{seconds:g}s"


def error_page(request: Request, exc: SettledError) -> Response:
    """A refused request under /console as a page: 404 (missing, or another tenant's), 403
    (the role may not), 422 (bad input); anything else 409."""
    status, key = 409, "msg.refused"
    if isinstance(exc, NotFound):
        status, key = 404, "error.404"
    elif isinstance(exc, Forbidden):
        status, key = 403, "error.403"
    elif isinstance(exc, InvalidInput):
        status, key = 422, "error.422"
    text = translate(_lang(request), key, message=exc.message)
    return render(request, None, "error.html", status=status, message=text)


@router.get("/")
def home() -> Response:
    """The console opens on the review queue."""
    return RedirectResponse("/console/review", status_code=303)


#: the largest id a row can have (PostgreSQL's BIGINT)
MAX_ROW_ID = 2**63 - 1


def _row_id(raw: str) -> int:
    """A row id from a path: anything but a whole number from 1 to ``MAX_ROW_ID`` names no
    row, so it is the page a missing one gets (never a database error)."""
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_ROW_ID:
        raise NotFound("no such item", code="not_found")
    return int(raw)


def _item_id(item_id: str) -> int:
    return _row_id(item_id)


def _proposal_id(proposal_id: str) -> int:
    return _row_id(proposal_id)


ItemId = Annotated[int, Depends(_item_id)]
ProposalId = Annotated[int, Depends(_proposal_id)]


def _blank(value: str | None) -> str | None:
    """A form or filter field: None when empty; a NUL (which no stored text can hold) is
    refused as bad input before any query."""
    if value is not None and "\x00" in value:
        raise InvalidInput("a NUL character is not allowed", code="nul_in_request")
    return value.strip() or None if value is not None else None


@router.get("/review")
def review_queue(
    request: Request,
    user: User,
    tenant: str | None = None,
    reason: str | None = None,
    kind: str | None = None,
    older_than: Annotated[str | None, Query(max_length=9)] = None,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Response:
    """Open review items, oldest first, filtered and paged (an empty filter is none); the
    list refreshes by itself (``queue_list``)."""
    return _queue(request, user, "review.html", tenant, reason, kind, older_than, offset)


@router.get("/queue")
def queue_list(
    request: Request,
    user: Polled,
    tenant: str | None = None,
    reason: str | None = None,
    kind: str | None = None,
    older_than: Annotated[str | None, Query(max_length=9)] = None,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Response:
    """The queue's list alone, as the queue page polls it: the same filters, the same page,
    the same tenant limits."""
    return _queue(request, user, "_queue.html", tenant, reason, kind, older_than, offset)


def _queue(
    request: Request, user: ConsoleUser, name: str, tenant: str | None, reason: str | None,
    kind: str | None, older_than: str | None, offset: int,
) -> Response:  # fmt: skip
    minutes = _minutes(older_than)
    filters = {"tenant": _blank(tenant), "reason": _blank(reason), "kind": _blank(kind)}
    page = _services(request).review.page(
        user.staff,
        tenant=filters["tenant"],
        reason=filters["reason"],
        kind=filters["kind"],
        older_than=timedelta(minutes=minutes) if minutes else None,
        offset=offset,
        limit=PAGE_SIZE,
    )
    query = urlencode(
        {
            **{k: v or "" for k, v in filters.items()},
            "older_than": "" if minutes is None else minutes,
        }
    )
    return render(
        request, user, name, page=page, filters=filters, older_than=minutes,
        reasons=sorted(REASONS), page_size=PAGE_SIZE, query=query,
    )  # fmt: skip


def _minutes(value: str | None) -> int | None:
    """The "older than" filter in whole minutes; None when empty."""
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit():
        raise InvalidInput("older than: a whole number of minutes", code="invalid_age")
    return int(value)


def _item_page(
    request: Request, user: ConsoleUser, item_id: int, message: str | None = None
) -> Response:
    shown = _services(request).review.show(user.staff, item_id)
    reason = shown["item"]["reason"]
    status = {"item": shown["item"], "operation": shown["operation"]}
    return render(
        request, user, "item.html", shown=shown, message=message, how=REASONS.get(reason, ""),
        item_status=status,
    )  # fmt: skip


@router.get("/review/{item_id}/status")
def review_item_status(request: Request, user: Polled, item_id: ItemId) -> Response:
    """An item's status alone (open or resolved by whom, the operation's state), as the item
    page polls it; the page's forms are outside it, so nothing typed in them is replaced."""
    status = _services(request).review.status(user.staff, item_id)
    return render(request, user, "_item_status.html", item_status=status)


@router.get("/review/{item_id}")
def review_item(request: Request, user: User, item_id: ItemId) -> Response:
    """One item: the operation, attempts, lookups, events, run, evidence, and the actions."""
    return _item_page(request, user, item_id)


@router.post("/review/{item_id}/requery", dependencies=Csrf)
def requery(request: Request, user: User, item_id: ItemId) -> Response:
    """Ask the downstream again now (the CLI's ``review requery``)."""
    lang = _lang(request)
    try:
        result = _services(request).review.requery(user.staff, item_id)
    except (ReviewConflict, InvalidInput) as exc:
        return _item_page(request, user, item_id, _refusal(request, user, item_id, exc))
    if result["lookup"] == "found":
        message = translate(lang, "msg.requery.found", state=named(lang, "state", result["state"]))
    else:
        message = translate(
            lang, "msg.requery.other", lookup=named(lang, "tl.lookup", result["lookup"])
        )
    return _item_page(request, user, item_id, message)


@router.post("/review/{item_id}/resolve", dependencies=Csrf)
def resolve(
    request: Request,
    user: User,
    item_id: ItemId,
    outcome: Annotated[str, Form(max_length=20)],
    version: Annotated[int, Form(ge=1, le=2**31 - 1)],
    reference: Annotated[str | None, Form(max_length=200)] = None,
    justification: Annotated[str | None, Form(max_length=4000)] = None,
    override: Annotated[bool, Form()] = False,
) -> Response:
    """Settle the item's operation as the form says; the service weighs it again."""
    try:
        result = _services(request).review.resolve(
            user.staff, item_id, outcome=outcome, version=version,
            reference=_blank(reference), justification=_blank(justification), override=override,
        )  # fmt: skip
    except (ReviewConflict, InvalidInput) as exc:
        return _item_page(request, user, item_id, _refusal(request, user, item_id, exc))
    lang = _lang(request)
    message = translate(lang, "msg.resolved", state=named(lang, "state", result["state"]))
    return _item_page(request, user, item_id, message)


def _refusal(request: Request, user: ConsoleUser, item_id: int, exc: SettledError) -> str:
    """What a refused action tells staff: who resolved it first and when, or why."""
    lang = _lang(request)
    if exc.code in ("lost_race", "already_resolved"):
        item = _services(request).review.show(user.staff, item_id)["item"]
        return translate(
            lang, "msg.already_resolved", by=formats.who(item["resolved_by"]),
            at=formats.exact(item["resolved_at"]),
        )  # fmt: skip
    return translate(lang, "msg.refused", message=exc.message)


@router.get("/find")
def find(
    request: Request,
    user: User,
    q: str | None = None,
    key: str = "op_id",
    value: str | None = None,
    tenant: str | None = None,
) -> Response:
    """The header's search box (``q``: any key at once, in the report's words), or operations
    by one key: tenant and op id, order id, idempotency key or run handle."""
    searched = None
    if q is not None and q.strip():
        searched = _services(request).finder.search(user.staff, q)
    found = None
    if value is not None and value.strip():
        found = _services(request).finder.find(user.staff, key, value, tenant=_blank(tenant))
    return render(
        request, user, "find.html", keys=KEYS, key=key, value=value or "", tenant=tenant or "",
        found=found, searched=searched, q=searched["q"] if searched else "",
    )  # fmt: skip


@router.get("/operations/{tenant}/{op_id}")
def operation_page(request: Request, user: User, tenant: str, op_id: str) -> Response:
    """One operation: done / not done / uncertain in the run report's words, its timeline."""
    shown = _services(request).finder.operation(user.staff, tenant, op_id)
    return render(request, user, "operation.html", shown=shown)


@router.get("/overview")
def overview(request: Request, user: User) -> Response:
    """Counts by state, the oldest unknown, the review depth, reconcile passes, the chart."""
    figures = _services(request).overview.read(user.staff)
    minutes = figures["minutes"]
    drawn = chart(
        [m.settled for m in minutes],
        [m.median_seconds for m in minutes],
        [m.p95_seconds for m in minutes],
    )
    return render(request, user, "overview.html", figures=figures, chart=drawn, frame=FRAME)


@router.get("/proposals")
def proposals(request: Request, user: User) -> Response:
    """The proposals AI agents made that wait for staff, oldest first, with what else is on
    each one's order."""
    waiting = _services(request).approvals.waiting(user.staff)
    return render(request, user, "proposals.html", waiting=waiting)


def _proposal_page(
    request: Request, user: ConsoleUser, proposal_id: int, message: str | None = None
) -> Response:
    shown = _services(request).approvals.show(user.staff, proposal_id)
    return render(request, user, "proposal.html", p=shown, message=message)


@router.get("/proposals/{proposal_id}")
def proposal(request: Request, user: User, proposal_id: ProposalId) -> Response:
    """One proposal: its parameters, reason, what else is on its order, approve and decline."""
    return _proposal_page(request, user, proposal_id)


@router.post("/proposals/{proposal_id}/approve", dependencies=Csrf)
def approve(request: Request, user: User, proposal_id: ProposalId) -> Response:
    """Approve (``settled proposals approve``): the exact parameters become an operation."""
    return _decide(request, user, proposal_id, "approve")


@router.post("/proposals/{proposal_id}/decline", dependencies=Csrf)
def decline(request: Request, user: User, proposal_id: ProposalId) -> Response:
    """Decline (``settled proposals decline``): nothing is sent."""
    return _decide(request, user, proposal_id, "decline")


def _decide(request: Request, user: ConsoleUser, proposal_id: int, verb: str) -> Response:
    approvals = _services(request).approvals
    lang = _lang(request)
    try:
        if verb == "approve":
            decision = approvals.approve(user.staff, proposal_id)
        else:
            decision = approvals.decline(user.staff, proposal_id)
    except (InvalidInput, ProposalConflict) as exc:  # e.g. the parameters no longer match
        message = translate(lang, "msg.refused", message=exc.message)
        return _proposal_page(request, user, proposal_id, message)
    p = decision.proposal
    if not decision.won and not p["decided_by"]:
        message = translate(
            lang, "msg.no_longer_waiting", status=translate(lang, f"proposal.status.{p['status']}")
        )
    elif not decision.won:
        message = translate(
            lang, "msg.already_decided", by=formats.who(p["decided_by"]),
            at=p["decided_at"] or "", status=translate(lang, f"proposal.status.{p['status']}"),
        )  # fmt: skip
    elif verb == "approve":
        message = translate(lang, "msg.approved", op_id=p["op_id"])
    else:
        message = translate(lang, "msg.declined")
    return _proposal_page(request, user, proposal_id, message)
