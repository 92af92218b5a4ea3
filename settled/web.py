"""The status API (``settled web``): run reports by handle, cancel, one operation; and the
support console under ``/console`` (``settled.console``); and WeChat Pay's refund-result
notifications at ``/notify/wechatpay/{tenant}`` (``settled.wechatpay_notify``: their signature,
not an API key, is checked).

Every request needs a tenant's API key (``Authorization: Bearer stk_...``): none or a bad one
answers 401. A handle or op_id of another tenant answers 404 with exactly the body of one that
does not exist, and so does one that could not exist (NUL, non-ASCII, overlong): ``outbox.runs``
refuses those before any SQL, so no database error turns bad input into a 500. Endpoints are
sync and use the sync session; the app is built by a factory, so importing this module creates
no engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote_plus

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox import logs, runs
from outbox.apikeys import Principal, authenticate
from outbox.errors import InvalidInput, NotFound, SettledError
from outbox.proposals import Proposals
from outbox.settings import Settings
from outbox.storage.connection import ping
from outbox.verdict_due import Cadence
from settled import metrics
from settled.console import auth, pages
from settled.runtime import Runtime, build_runtime
from settled.wechatpay_notify import notify_routes
from support.review import ReviewQueue

access_log = logging.getLogger("settled.access")

NOT_FOUND = {"error": {"code": "not_found", "message": "not found"}}
UNAUTHORIZED = {"error": {"code": "unauthorized", "message": "missing or invalid API key"}}


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class Unauthorized(Exception):
    """No API key, or one that is not valid."""


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or invalid API key"},
    404: {"model": ErrorBody, "description": "no such run or operation for this tenant"},
    422: {"model": ErrorBody, "description": "invalid request"},
}

_bearer = HTTPBearer(auto_error=False, description="a tenant API key: stk_<id>_<secret>")


def _session(request: Request) -> Iterator[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    with sessions() as s:
        yield s


DB = Annotated[Session, Depends(_session)]


def _principal(
    request: Request,
    s: DB,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    who = authenticate(s, creds.credentials if creds is not None else None)
    if who is None:
        raise Unauthorized
    request.state.tenant = who.tenant  # for the access log
    return who


# Module level: with postponed annotations FastAPI resolves these names in module globals.
Auth = Annotated[Principal, Depends(_principal)]
LangQuery = Annotated[
    Literal["en", "zh"] | None, Query(description="add the report rendered as text")
]


# -- the status API: runs and operations, each read authorised for the key's tenant -----------

status_api = APIRouter(responses=ERRORS)


def _cadence(request: Request) -> Cadence:
    """The reconciler's numbers (``Runtime.cadence``): an uncertain answer's time."""
    cadence: Cadence = request.app.state.cadence
    return cadence


Timing = Annotated[Cadence, Depends(_cadence)]


@status_api.get("/v1/runs/{handle}", summary="The report of a run")
def get_run(
    handle: str, who: Auth, s: DB, cadence: Timing, lang: LangQuery = None
) -> dict[str, Any]:
    """Done / not done / uncertain, from states and receipts; ``lang`` adds the text. An
    uncertain line's evidence says what it waits for (``waits_for``) and the latest it is
    decided by (``verdict_by``, ISO 8601; null while support staff decide)."""
    return runs.run_report(s, who.tenant, handle, cadence=cadence).as_dict(lang)


@status_api.post("/v1/runs/{handle}/cancel", summary="Stop a run")
def cancel_run(
    handle: str, who: Auth, s: DB, cadence: Timing, lang: LangQuery = None
) -> dict[str, Any]:
    """Cancel the run's unsent operations; already-sent ones stay pending confirmation."""
    # The key's check only read; the cancel is a transaction of its own, begun explicitly so
    # that on SQLite it takes the write lock first (``outbox.db.SQLITE_BEGIN``). On any error
    # it rolls back: nothing is written.
    s.rollback()
    with s.begin():
        done = runs.cancel_run(s, who.tenant, handle, actor=f"api_key:{who.key_id}")
    cancelled = len(done.cancelled_ids)
    report = runs.run_report(s, who.tenant, handle, cadence=cadence)
    return {
        "cancelled_now": cancelled,
        "already_requested": done.already_requested,
        "report": report.as_dict(lang),
    }


@status_api.get("/v1/operations/{op_id}", summary="One operation")
def get_operation(
    op_id: str, who: Auth, s: DB, cadence: Timing, lang: LangQuery = None
) -> dict[str, Any]:
    """One operation of the key's tenant: state, group, evidence, compensations; ``lang``
    adds its sentence (``text``). An uncertain one's evidence says what it waits for
    (``waits_for``) and the latest it is decided by (``verdict_by``)."""
    return runs.operation_status(s, who.tenant, op_id, cadence=cadence, lang=lang)


# -- for operators: health and metrics, no key, not in the API document ------------------------

operator_routes = APIRouter(include_in_schema=False)


@operator_routes.get("/healthz")
def healthz(s: DB) -> dict[str, str]:
    """Liveness and database reachability, for the orchestrator's health check."""
    ping(s)
    return {"status": "ok"}


@operator_routes.get("/metrics")
def prometheus(request: Request) -> Response:
    """Prometheus metrics, read from the database."""
    registry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# -- every answer is JSON: errors in one shape ------------------------------------------------


def _unauthorized(_request: Request, _exc: Unauthorized) -> JSONResponse:
    return JSONResponse(UNAUTHORIZED, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _not_found(_request: Request, _exc: NotFound) -> JSONResponse:
    # One body for "does not exist" and "belongs to another tenant": no oracle.
    return JSONResponse(NOT_FOUND, status_code=404)


def _invalid(_request: Request, exc: InvalidInput) -> JSONResponse:
    return JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=422)


def _conflict(_request: Request, exc: SettledError) -> JSONResponse:
    return JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=409)


def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    fields = [".".join(str(p) for p in e.get("loc", ())) for e in exc.errors()]
    return JSONResponse(
        {"error": {"code": "invalid_request", "message": "invalid request", "fields": fields}},
        status_code=422,
    )


def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return JSONResponse(NOT_FOUND, status_code=404)
    code = "method_not_allowed" if exc.status_code == 405 else "http_error"
    return JSONResponse(
        {"error": {"code": code, "message": str(exc.detail)}},
        status_code=exc.status_code,
        headers=exc.headers,
    )


#: exception -> its JSON answer (Starlette picks the handler of the nearest class)
ERROR_HANDLERS: dict[type[Exception], Callable[..., JSONResponse]] = {
    Unauthorized: _unauthorized,
    NotFound: _not_found,
    InvalidInput: _invalid,
    SettledError: _conflict,
    RequestValidationError: _validation,
    StarletteHTTPException: _http,
}


def _answer(json_answer: Callable[..., JSONResponse]) -> Callable[..., Response]:
    """``json_answer`` for the API; a page for the console's refused requests."""

    def answer(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/console/") and isinstance(exc, SettledError):
            return pages.error_page(request, exc)
        return json_answer(request, exc)

    return answer


# -- the access log ---------------------------------------------------------------------------


async def log_access(request: Request, call_next: Any) -> Any:
    """One line per request: method, path (never the query), status, duration, and the
    tenant once its key was accepted; the client's address is not logged."""
    started = time.monotonic()
    status = 500
    try:
        response = await call_next(request)
        status = response.status_code
        return response
    finally:
        access_log.info(
            "request",
            extra={
                "method": request.method,
                "path": request.url.path[:200],
                "status": status,
                "duration_ms": round((time.monotonic() - started) * 1000, 1),
                "tenant": getattr(request.state, "tenant", None),
            },
        )


# -- the console's security headers ---------------------------------------------------------

#: what the console's pages allow a browser to load and do: its own scripts and styles only
#: (no inline script or style: htmx is told not to inject its indicator style), no framing
#: by any other page (a page on another origin cannot frame the sign-in form), forms that post
#: only back to the console
CONSOLE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'; "
    "object-src 'none'"
)
#: on every answer under /console/ (pages, error pages, sign-in, redirects, static files)
CONSOLE_HEADERS = {
    "Content-Security-Policy": CONSOLE_CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
STATIC = "/console/static/"
NUL_REFUSED = "a NUL character is not allowed in a path or a query"


def _has_nul(request: Request) -> bool:
    query = unquote_plus(request.scope.get("query_string", b"").decode("latin-1"))
    return "\x00" in request.url.path or "\x00" in query


async def console_headers(request: Request, call_next: Any) -> Any:
    """The console's security headers; every console answer but a static file is
    ``Cache-Control: no-store`` (its pages carry customer data: amounts, payees, orders)."""
    path = request.url.path
    console = path == "/console" or path.startswith("/console/")
    if console and _has_nul(request):
        # PostgreSQL cannot store or compare a NUL in text: refused here, before any query
        response = pages.error_page(request, InvalidInput(NUL_REFUSED, code="nul_in_request"))
    else:
        response = await call_next(request)
    if console:
        response.headers.update(CONSOLE_HEADERS)
        if not path.startswith(STATIC):
            response.headers["Cache-Control"] = "no-store"
    return response


# -- the app ----------------------------------------------------------------------------------


def create_web_app(
    source: Settings | sessionmaker[Session] | Runtime,
    *,
    review: ReviewQueue | None = None,
    proposals: Proposals | None = None,
) -> FastAPI:
    """The status API and the support console over ``source``: a runtime (the composition
    root's, ``settled.runtime``), or settings or a sessionmaker to build one from (closed on
    shutdown; a sessionmaker's engine stays the caller's). The console works with the
    runtime's services; ``review`` and ``proposals`` replace the runtime's (tests)."""
    runtime, owned = _runtime_of(source)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            runtime.close()

    app = FastAPI(
        title="Settled status API",
        version="1",
        description="What a run has done, has not done, and what is still uncertain.",
        lifespan=lifespan,
    )
    app.state.sessions = runtime.sessions
    app.state.cadence = runtime.cadence
    app.state.metrics_registry = metrics.registry(runtime.sessions)
    app.middleware("http")(console_headers)
    app.middleware("http")(log_access)
    for error, handler in ERROR_HANDLERS.items():
        app.exception_handler(error)(_answer(handler))
    app.include_router(status_api)
    app.include_router(operator_routes)
    # WeChat Pay's refund-result notifications: no API key, their signature is checked
    app.state.wechatpay_notifications = runtime.wechatpay_notifications
    app.include_router(notify_routes)
    app.state.console = pages.ConsoleServices(runtime, review, proposals)
    auth.configure(app, runtime.settings)  # sessions' lifetimes, sign-in throttling, cookies
    app.include_router(auth.router)
    app.include_router(pages.router)
    static = Path(pages.__file__).parent / "static"
    app.mount("/console/static", StaticFiles(directory=static), name="console-static")
    return app


def _runtime_of(source: Settings | sessionmaker[Session] | Runtime) -> tuple[Runtime, bool]:
    """The runtime to serve from, and whether it was built here (closed on shutdown)."""
    if isinstance(source, Runtime):
        return source, False
    if isinstance(source, Settings):
        return build_runtime(source), True
    return build_runtime(Settings(), sessions=source), True


def serve(settings: Settings, *, host: str, port: int) -> None:
    """Run the status API with uvicorn (blocking). Every line goes through ``outbox.logs``:
    uvicorn's own messages as they are, and instead of its access log (client address, path
    with query) the app's own (``settled.access``, with the duration and the tenant)."""
    import uvicorn

    from settled.supervise import say_ready

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening (a port taken exits instead)
                say_ready()

    logs.configure(settings.log_level, settings.log_format)
    config = uvicorn.Config(
        create_web_app(settings),
        host=host,
        port=port,
        log_config=None,
        log_level=settings.log_level.lower(),
        access_log=False,
    )
    server = Server(config)
    with suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(3)  # as ``uvicorn.run``: it never served (its error is logged)
