"""The downstream over HTTP: one attempt per call, classified into the gateway's outcome values.

Never retries (the executor owns retries), never spends past the operation's deadline, and
splits transport errors by phase: nothing sent (pool, resolve, connect, TLS, the first byte
refused once the bound passed: ``workers.transport``) vs maybe sent (read, write, protocol).
No byte of a request leaves after its attempt's bound (``workers.transport``). The protocol
is documented in docs/wire-protocol.md; what a response that came back proves is
``workers.http_classify``. ``probe_fence`` sends the deadline fence's probe, which the start's
checks ask for (``settled.preflight``).

Connections are kept alive in a pool shared by the threads that send a batch, and what does not
change between calls (endpoint URLs, the tenants' Authorization values) is built once. An
attempt builds its ``httpx.Request`` itself and hands it straight to the transport: there is no
client layer (no auth flow, no redirects, no cookie jar), so the request goes out exactly as
built.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from pydantic import SecretStr

from outbox import wire
from outbox.clock import Deadline
from outbox.downstream import (
    DownstreamRequest,
    Effect,
    EffectsListed,
    EffectsOutcome,
    LookupOutcome,
    NotListed,
    NotSent,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
    listed_so_far,
    valid_reference,
)
from outbox.downstream_clock import corrected_deadline
from outbox.kinds import Kind
from outbox.port_shim import old_keywords
from outbox.states import RejectReason
from workers.downstream_time import LagSeen, TimeSeen, tell_time
from workers.http_classify import (
    FenceProbe,
    classify_lookup,
    classify_probe,
    classify_submit,
    probe_unanswered,
)
from workers.transport import (
    NOT_SENT_ERRORS,
    BoundedTransport,
    bound_request,
    error_name,
    not_sent,
)

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]

#: Keep-alive connections the pool keeps: the executor sends a batch from up to 16 threads
#: through one gateway.
POOL_SIZE = 16
#: An idle pooled connection is dropped after this many seconds. It must stay well below the
#: downstream's idle timeout (the simulator's ``IDLE_TIMEOUT_SECONDS``, 20 s), so the client
#: always drops an idle connection before the server does and practically never reuses one the
#: server is closing. If that happens anyway, the attempt fails with a ReadError or
#: RemoteProtocolError: "maybe sent", i.e. Unknown. That is safe, never a "not sent": the
#: executor then looks the key up and never re-sends blindly.
KEEPALIVE_EXPIRY_SECONDS = 5.0
#: At most this many connections at once (more callers than this wait for one, within their
#: timeout, and end as PoolTimeout: not sent).
MAX_CONNECTIONS = 64

#: The longest the fence's probe waits for its answer (never more than the gateway's timeout):
#: a start waits for it, once per fenced kind.
PROBE_TIMEOUT_SECONDS = 5.0

#: The request may have reached the downstream: its outcome is unknown.
_MAYBE_SENT_ERRORS = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _ms_since(started: float) -> float:
    """Milliseconds since ``started`` (monotonic clock), for the log."""
    return round((time.monotonic() - started) * 1000, 1)


class _Left(dict[str, float]):
    """httpcore's per-phase timeouts (pool, connect, write, read), each what is left of the
    whole attempt when the phase starts (httpcore asks for a phase's timeout as the phase
    begins). Not enough on its own: a phase is timed from its own start, and each read
    separately; ``workers.transport`` bounds them by the whole attempt. This bounds the wait
    for a pooled connection, and any other transport."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def get(self, key: str, default: Any = None) -> float:
        # Never 0, which some transports read as "no timeout": a phase that starts with
        # nothing left fails at once (a timeout), classified by its phase as usual.
        return max(self._deadline.left(), 0.001)


class HttpGateway:
    """The ``Gateway`` port over the Stripe-like HTTP protocol of docs/wire-protocol.md."""

    def __init__(
        self,
        base_url: str,
        api_keys: Mapping[str, SecretStr],
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        clock: Clock = _utcnow,
        time_seen: TimeSeen | None = None,
        lag_seen: LagSeen | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        #: tenant -> the Authorization value (a SecretStr: never in a repr or a log)
        self._authorization = {
            tenant: SecretStr(f"Bearer {key.get_secret_value()}")
            for tenant, key in api_keys.items()
        }
        self._timeout = timeout
        self._clock = clock
        self._time_seen = time_seen
        self._lag_seen = lag_seen
        # httpx's base_url semantics: the endpoint's path is appended to the base URL's path.
        self._base_url = str(httpx.URL(base_url)).rstrip("/")
        self._urls: dict[str, httpx.URL] = {}
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS,
            max_keepalive_connections=POOL_SIZE,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
        )
        # Never redirects (no client follows them), never retries, no proxy from the environment;
        # nothing leaves after an attempt's bound (``workers.transport``).
        self._transport = transport or BoundedTransport(limits=limits)

    def close(self) -> None:
        """Close the connection pool."""
        self._transport.close()

    def __enter__(self) -> HttpGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @old_keywords
    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        """Send one attempt; never retries; never spends past ``deadline``."""
        tenant, kind, idempotency_key = request.tenant, request.kind, request.idempotency_key
        params = request.params
        key = self._authorization.get(tenant)
        if key is None:
            log.warning(
                "submit refused locally: no API key for the tenant",
                extra={"tenant": tenant, "kind": kind.name, "key": idempotency_key},
            )
            return Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0)
        until = self._deadline(deadline)
        if until.left() <= 0:
            log.info(
                "submit not sent: deadline passed",
                extra={"tenant": tenant, "kind": kind.name, "key": idempotency_key},
            )
            return NotSent("deadline passed before sending", SendPhase.BEFORE)
        url = self._urls.get(kind.endpoint)
        if url is None:
            url = self._urls[kind.endpoint] = httpx.URL(self._base_url + kind.endpoint)
        headers = self._headers(key, until, kind)
        headers[wire.IDEMPOTENCY_KEY] = idempotency_key
        headers["Content-Type"] = "application/json"
        # As httpx encodes ``json=``: compact, UTF-8, no NaN.
        body = json.dumps(dict(params), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        fields = {"tenant": tenant, "kind": kind.name, "key": idempotency_key}
        started, began = time.monotonic(), until.monotonic()
        try:
            response = self._send("POST", url, headers, body.encode(), until)
        except NOT_SENT_ERRORS as exc:
            unsent = not_sent(exc)
            assert unsent is not None  # every one of NOT_SENT_ERRORS
            log.info(
                "submit not sent",
                extra={
                    **fields,
                    "error": unsent.detail,
                    "phase": unsent.phase.value,
                    "duration_ms": _ms_since(started),
                },
            )
            return unsent
        except _MAYBE_SENT_ERRORS as exc:
            log.warning(
                "submit outcome unknown",
                extra={**fields, "error": type(exc).__name__, "duration_ms": _ms_since(started)},
            )
            return Unknown(type(exc).__name__)
        self._saw_time(kind, response, until, began)
        outcome = classify_submit(
            response, kind, params, now=self._clock(), idempotency_key=idempotency_key
        )
        log.info(
            "submit answered",
            extra={
                **fields,
                "status": response.status_code,
                "proof": outcome.proof.value,
                "duration_ms": _ms_since(started),
            },
        )
        return outcome

    @old_keywords
    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        """Ask what happened to the request's key; the receipt is checked against its params."""
        tenant, kind, idempotency_key = request.tenant, request.kind, request.idempotency_key
        params = request.params
        key = self._authorization.get(tenant)
        if key is None:
            return Unavailable("no API key configured for the tenant")
        until = self._deadline(deadline)
        if until.left() <= 0:
            return Unavailable("deadline passed before sending")
        path = wire.LOOKUP_PATH.format(key=quote(idempotency_key, safe=""))
        url = httpx.URL(self._base_url + path)
        fields = {"tenant": tenant, "kind": kind.name, "key": idempotency_key}
        started, began = time.monotonic(), until.monotonic()
        try:
            response = self._send("GET", url, self._headers(key, until, kind), None, until)
        except httpx.TransportError as exc:
            log.info(
                "lookup unavailable",
                extra={**fields, "error": error_name(exc), "duration_ms": _ms_since(started)},
            )
            return Unavailable(error_name(exc))
        self._saw_time(kind, response, until, began)
        outcome = classify_lookup(response, params, idempotency_key=idempotency_key)
        log.info(
            "lookup answered",
            extra={
                **fields,
                "status": response.status_code,
                "lookup": type(outcome).__name__,
                "duration_ms": _ms_since(started),
            },
        )
        return outcome

    def effects_since(
        self, tenant: str, since: datetime, /, *, deadline: Deadline | datetime
    ) -> EffectsOutcome:
        """The tenant's effects since ``since`` from the optional list of effects
        (docs/wire-protocol.md, "List of effects"), page after page while ``deadline`` lasts; a
        downstream that does not serve it (a bare 404 or 405) is ``NotListed``."""
        key = self._authorization.get(tenant)
        if key is None:
            return NotListed("no API key configured for the tenant")
        until = self._deadline(deadline)
        effects: list[Effect] = []
        query: dict[str, str] = {
            "since": f"{since.timestamp():.3f}",
            "limit": str(wire.EFFECTS_PAGE_MAX),
        }
        while True:
            if until.left() <= 0:
                return EffectsListed(tuple(effects), False, "deadline passed before the last page")
            url = httpx.URL(self._base_url + wire.EFFECTS_PATH + "?" + urlencode(query))
            headers = {
                wire.AUTHORIZATION: key.get_secret_value(),
                wire.DEADLINE: wire.format_deadline(until.at),
            }
            try:
                response = self._send("GET", url, headers, None, until)
            except httpx.TransportError as exc:
                return listed_so_far(effects, f"listing effects failed ({error_name(exc)})")
            if response.status_code in (404, 405) and not effects:
                return NotListed("the downstream serves no list of effects (GET /v1/effects)")
            page = _effects_page(response, tenant)
            if page is None:
                return listed_so_far(
                    effects, f"a page of effects was not readable ({response.status_code})"
                )
            listed, has_more = page
            effects.extend(listed)
            if not has_more:
                return EffectsListed(tuple(effects))
            if not listed or listed[-1].reference == query.get("starting_after"):
                return listed_so_far(effects, "the list of effects has more but does not page on")
            query["starting_after"] = listed[-1].reference

    def probe_fence(self, kind: Kind, *, timeout: float = PROBE_TIMEOUT_SECONDS) -> FenceProbe:
        """Send the deadline fence's probe to ``kind``'s endpoint and say what its answer proves
        (docs/wire-protocol.md, "The fence's probe"): one request past its ``Settled-Deadline``,
        under a key of its own and with a body no intent has, so no server executes it; bounded
        by ``timeout`` (and the gateway's own), never retried."""
        tenants = sorted(self._authorization)
        if not tenants:
            return FenceProbe(
                False, "no API key configured (SETTLED_DOWNSTREAM_API_KEYS) to send the probe with"
            )
        seconds = min(timeout, self._timeout)
        now = self._clock()
        until = Deadline(now + timedelta(seconds=seconds), time.monotonic() + seconds)
        headers = {
            wire.AUTHORIZATION: self._authorization[tenants[0]].get_secret_value(),
            # Past on any clock within an hour of ours: a fence refuses it before anything else.
            wire.DEADLINE: wire.format_deadline(
                now - timedelta(seconds=wire.PROBE_DEADLINE_AGO_SECONDS)
            ),
            wire.PROBE: wire.PROBE_DEADLINE_FENCE,
            wire.IDEMPOTENCY_KEY: wire.PROBE_KEY_PREFIX + secrets.token_hex(16),
            "Content-Type": "application/json",
        }
        body = json.dumps(wire.PROBE_BODY, separators=(",", ":")).encode()
        url = httpx.URL(self._base_url + kind.endpoint)
        started = time.monotonic()
        try:
            response = self._send("POST", url, headers, body, until)
        except httpx.TransportError as exc:
            found = probe_unanswered(error_name(exc))
        else:
            found = classify_probe(response)
        # Debug: the start line says which fences were verified, and a failure stops the start.
        log.debug(
            "deadline fence probed: " + ("verified" if found.verified else "not verified"),
            extra={"kind": kind.name, "duration_ms": _ms_since(started)},
        )
        return found

    def endpoint_shown(self, kind: Kind) -> str:
        """``kind``'s endpoint URL as a message may show it: no user, password or query."""
        url = httpx.URL(self._base_url + kind.endpoint)
        port = f":{url.port}" if url.port is not None else ""
        return f"{url.scheme}://{url.host}{port}{url.path}"

    def _deadline(self, deadline: Deadline | datetime) -> Deadline:
        """The attempt's deadline: the caller's, and never more than the configured timeout."""
        if isinstance(deadline, datetime):  # on this process's wall clock
            deadline = Deadline.from_wall(deadline, self._clock())
        return deadline.capped(self._timeout)

    def _saw_time(
        self, kind: Kind, response: httpx.Response, until: Deadline, began: float
    ) -> None:
        """Tell ``time_seen`` the downstream's time the answer says, if it says one (``began``:
        the deadline's monotonic clock when the request started; ``workers.downstream_time``)."""
        if self._time_seen is not None:
            said = wire.server_time(response.headers)
            tell_time(self._time_seen, kind.name, said, until, began)

    def _headers(self, authorization: SecretStr, deadline: Deadline, kind: Kind) -> dict[str, str]:
        # The downstream is told the caller's deadline (database time), capped by this
        # attempt's own timeout; for a fenced kind, earlier by the lag its clock was last
        # measured behind (``lag_seen``), so its fence cuts at that deadline in database time,
        # never later. (An unfenced kind's 408 goes to review: its header is never moved.)
        lag = None
        if kind.contract.enforces_deadline and self._lag_seen is not None:
            lag = self._lag_seen(kind.name)
        return {
            wire.AUTHORIZATION: authorization.get_secret_value(),
            wire.DEADLINE: wire.format_deadline(corrected_deadline(deadline.at, lag)),
        }

    def _send(
        self,
        method: str,
        url: httpx.URL,
        headers: dict[str, str],
        content: bytes | None,
        deadline: Deadline,
    ) -> httpx.Response:
        """One request exactly as built, its whole body read (errors reading it are raised).

        The whole attempt, not each phase, is bounded by ``deadline``: the transport's every
        phase (``bound_request``; httpcore's per-phase timeouts from ``_Left`` for any other
        transport), and the body is read only while time is left.
        """
        request = httpx.Request(
            method,
            url,
            headers=headers,
            content=content,
            extensions={"timeout": _Left(deadline)},
        )
        with bound_request(deadline):
            response = self._transport.handle_request(request)
            try:
                if response.is_stream_consumed:  # read already (an in-memory transport)
                    return response
                chunks = []
                for chunk in response.iter_raw():
                    chunks.append(chunk)
                    if deadline.left() <= 0:
                        raise httpx.ReadTimeout("the attempt's deadline passed", request=request)
            finally:
                response.close()  # back to the pool (or closed, after an error)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=b"".join(chunks),
            request=request,
        )


def _effects_page(response: httpx.Response, tenant: str) -> tuple[list[Effect], bool] | None:
    """One page of the list of effects: its effects and whether more follow; None where the
    answer is not a readable page (an entry without a storable id makes it unreadable)."""
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    effects = []
    for entry in data:
        if not isinstance(entry, dict) or not valid_reference(entry.get("id")):
            return None
        echoed = entry.get("params")
        params: dict[str, Any] = echoed if isinstance(echoed, dict) else {}
        key, created = entry.get("idempotency_key"), entry.get("created")
        amount = params.get("amount_minor")
        effects.append(
            Effect(
                downstream="http",
                tenant=tenant,
                reference=entry["id"],
                idempotency_key=key if isinstance(key, str) else None,
                op_id=None,  # the protocol keeps only the key, a one-way function of the op id
                amount_minor=amount if isinstance(amount, int) else None,
                currency=str(params["currency"]) if params.get("currency") else None,
                status=str(entry.get("status", "")),
                created=(
                    datetime.fromtimestamp(created, UTC)
                    if isinstance(created, int | float) and not isinstance(created, bool)
                    else None
                ),
            )
        )
    return effects, bool(body.get("has_more"))
