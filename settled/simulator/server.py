"""The simulator's HTTP server: a small commerce backend with Stripe-like idempotency.

Order of a submit: authenticate, draw a fault, the faults that act before the idempotency layer
(429, 503_before, reset_before), validate, the idempotency layer (replay, conflict, in flight),
execute and save, then the faults that act on the answer (hold, reset). See
README.md, "Wire protocol" for the protocol and the control API.

Connections are HTTP/1.1 keep-alive: a connection, and the thread that serves it, carries request
after request, so a submit costs no connect and no thread start. Request heads are parsed by a
small reader and each answer goes out in one write.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import hashlib
import json
import logging
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from outbox import logs, wire
from outbox.errors import InvalidParams
from outbox.kinds import Kind, default_registry
from settled.simulator.faults import Fault, FaultBook, Rule, Schedule
from settled.simulator.ledger import Ledger, Scripted, engine_for, kind_of_object
from settled.simulator.messages import Response

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/_control/"
LOOKUP_PREFIX = wire.LOOKUP_PATH.format(key="")
MAX_BODY = 64 * 1024
MAX_LINE = 65536
MAX_HEADERS = 100
DEFAULT_HOLD_SECONDS = 30.0
#: How long a keep-alive connection may sit idle (or a read or write stall) before the server
#: closes it. It must stay well above the clients' keep-alive expiry (HttpGateway's
#: ``KEEPALIVE_EXPIRY_SECONDS``, httpx's default 5 s): a client then always drops an idle
#: connection before the server does, and practically never sends a request on a connection the
#: server is closing. (Should that race happen anyway, the client sees a read error, which it
#: classifies as "maybe sent": safe, the executor then looks the key up, never re-sends.)
IDLE_TIMEOUT_SECONDS = 20.0

#: Faults that change what a fresh execution does or saves (counted when they do).
_CHANGE_EXECUTION = frozenset(
    {Fault.BUSINESS_REJECT, Fault.MISMATCHED_RECEIPT, Fault.UNAVAILABLE_AFTER_COMMIT}
)
#: Faults on the answer (counted on fresh executions and replays alike).
_ON_ANSWER = frozenset({Fault.COMMIT_THEN_TIMEOUT, Fault.COMMIT_THEN_RESET})

_AUTHORIZATION = wire.AUTHORIZATION.lower()
_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY.lower()
_DEADLINE = wire.DEADLINE.lower()


@dataclass(frozen=True)
class Switches:
    """Global behaviour of the downstream, changed through the control API."""

    idempotency: bool = True  # off: every request executes anew
    lookup: bool = True  # off: there is no lookup API (its route answers a bare 404)
    key_retention_seconds: float | None = 24 * 3600.0  # None: keys are never forgotten
    lookup_visibility_delay: float = 0.0  # seconds before a result shows in lookups


class Simulator:
    """The state behind the HTTP handlers (ledger, faults, switches, clock, holds)."""

    def __init__(self, ledger: Ledger, *, test_mode: bool) -> None:
        self.ledger = ledger
        self.test_mode = test_mode
        self.faults = FaultBook()
        self.switches = Switches()
        registry = default_registry()
        self.kinds = {kind.endpoint: kind for kind in map(registry.get, registry.names())}
        #: makes "check the key, then mark it in flight" one step
        self.idempotency_lock = threading.Lock()
        self.stopping = threading.Event()
        self._clock_offset = 0.0
        self._requests: Counter[tuple[str, str, str]] = Counter()
        #: faults that acted on a request, by fault name (a drawn fault that found nothing
        #: to act on, e.g. ``503_after_commit`` on a replay, is not counted)
        self._injected: Counter[str] = Counter()
        self._deadlines: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._release = threading.Condition()
        self._release_generation = 0

    def now(self) -> float:
        return time.time() + self._clock_offset

    def advance_clock(self, seconds: float) -> None:
        with self._lock:
            self._clock_offset += seconds

    def count_request(self, phase: str, tenant: str, key: str, deadline: str | None) -> int:
        """Number this request among those of its (phase, tenant, key), from 1."""
        with self._lock:
            self._requests[(phase, tenant, key)] += 1
            if deadline is not None:
                self._deadlines[(tenant, key)] = deadline
            return self._requests[(phase, tenant, key)]

    def note_injected(self, fault: Fault) -> None:
        """Count ``fault`` as injected: it acted on the request being served."""
        with self._lock:
            self._injected[fault.value] += 1

    def injected(self) -> dict[str, int]:
        """Faults injected so far, by fault name (since start or the last reset)."""
        with self._lock:
            return dict(sorted(self._injected.items()))

    def requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "phase": phase,
                    "tenant": tenant,
                    "idempotency_key": key,
                    "count": count,
                    "last_deadline": self._deadlines.get((tenant, key)),
                }
                for (phase, tenant, key), count in sorted(self._requests.items())
            ]

    def retention_floor(self) -> float | None:
        retention = self.switches.key_retention_seconds
        return None if retention is None else self.now() - retention

    def release_holds(self) -> None:
        with self._release:
            self._release_generation += 1
            self._release.notify_all()

    def hold(self, connection: socket.socket, seconds: float) -> str:
        """Wait until released, stopped, the client hung up, or ``seconds`` passed; say which."""
        end = time.monotonic() + seconds
        with self._release:
            generation = self._release_generation
        while True:
            if self.stopping.is_set():
                return "stopping"
            if time.monotonic() >= end:
                return "expired"
            with self._release:
                if self._release_generation != generation:
                    return "released"
                self._release.wait(0.02)
            if _peer_closed(connection):
                return "client_gone"

    def reset(self) -> None:
        self.ledger.reset()
        self.faults.clear()
        with self._lock:
            self.switches = Switches()
            self._clock_offset = 0.0
            self._requests.clear()
            self._injected.clear()
            self._deadlines.clear()
        self.release_holds()


def _peer_closed(connection: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        if not readable:
            return False
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def fingerprint(path: str, params: Mapping[str, Any]) -> str:
    """What "the same request" means for the idempotency layer: the path and the body."""
    canonical = json.dumps({"path": path, "params": params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # join handler threads on close: no thread outlives stop()
    block_on_close = True
    # The listen backlog (socketserver's default is 5): a batch opens its connections all at
    # once, and a connect dropped from a full backlog is retried only a second later.
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], sim: Simulator, idle_timeout: float = IDLE_TIMEOUT_SECONDS
    ) -> None:
        self.sim = sim
        self.idle_timeout = idle_timeout
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Registered here, in the serving thread, so server_close sees every accepted connection.
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def open_connections(self) -> int:
        with self._connections_lock:
            return len(self._connections)

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:  # only once closed: "not open" means the client can see it closed
            with self._connections_lock:
                self._connections.discard(request)

    def server_close(self) -> None:
        """Stop listening, end every connection's reading side, join every handler thread.

        A thread waiting for the next request on an idle keep-alive connection then reads EOF
        and ends at once; a thread busy with a request still writes its answer, then ends.
        """
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RD)
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up on a held response is the point of some faults, not an error.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Dropped(Exception):
    """The connection was closed without an answer (a reset or a held response)."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Keep-alive: clients do not pipeline (the next request leaves after the answer), so a reset
    # still hits exactly one request, the one in flight on the connection.
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # an answer is one write; send it at once
    _dropped = False
    #: the request's header fields, by lower-case name (the first of repeated fields)
    fields: dict[str, str]

    @property
    def sim(self) -> Simulator:
        return self.server.sim

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)  # http.server's own notes (errors); never the client address

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = self.path.split("?", 1)[0]
        if path.startswith(LOOKUP_PREFIX):
            path = wire.LOOKUP_PATH  # the route, not the key in it
        log.debug("request", extra={"method": self.command, "path": path[:200], "status": code})

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)

    def handle(self) -> None:
        with contextlib.suppress(_Dropped):
            super().handle()

    def handle_one_request(self) -> None:
        """Serve the connection's next request, or mark the connection as ending."""
        self.close_connection = True
        try:
            line = self.rfile.readline(MAX_LINE + 1)
            if not line:
                return  # the client closed the connection (or stop() ended its reading side)
            if len(line) > MAX_LINE:
                self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
                self._refuse(414, "request_line_too_long", "request line too long")
                return
            if not self._parse_head(line):
                return
            if self.command not in ("GET", "POST", "DELETE"):
                self._refuse(501, "unsupported_method", "unsupported method")
                return
            self._dispatch(self.command)
        except TimeoutError:
            self.close_connection = True  # idle past the idle timeout, or a stalled transfer

    def _parse_head(self, request_line: bytes) -> bool:
        """Read the request line and header fields (a lean stand-in for the stdlib's parser).

        On failure an error has been answered or the connection is to be closed; return False.
        """
        self.command = ""
        self.request_version = "HTTP/1.1"  # what an error about the request line answers in
        self.requestline = str(request_line, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3 or words[2] not in ("HTTP/1.1", "HTTP/1.0"):
            self._refuse(400, "bad_request_line", "bad request line")
            return False
        self.command, self.path, self.request_version = words
        fields: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            line = self.rfile.readline(MAX_LINE + 1)
            if len(line) > MAX_LINE:
                self._refuse(431, "header_too_long", "header line too long")
                return False
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                return False  # the client went away mid-request
            name, colon, value = line.partition(b":")
            if not colon or not name.strip():
                self._refuse(400, "bad_header_line", "bad header line")
                return False
            field = name.strip().lower().decode("latin-1")
            fields.setdefault(field, value.strip().decode("latin-1"))
        else:
            self._refuse(431, "too_many_headers", "too many header fields")
            return False
        self.fields = fields
        connection = fields.get("connection", "").lower()
        if self.request_version == "HTTP/1.1":
            self.close_connection = connection == "close"
        else:
            self.close_connection = connection != "keep-alive"
        return True

    def finish(self) -> None:
        if not self._dropped:
            super().finish()

    # -- routing ------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        body = self._read_body()
        path = self.path.split("?", 1)[0]
        if path.startswith(CONTROL_PREFIX):
            if not self.sim.test_mode:
                self._error(404, wire.NOT_FOUND_ERROR, "no_such_route", "no such route")
            else:
                self._control(method, path[len(CONTROL_PREFIX) :], body)
        elif method == "POST" and path in self.sim.kinds:
            self._submit(self.sim.kinds[path], path, body)
        elif method == "GET" and path.startswith(LOOKUP_PREFIX):
            self._lookup(unquote(path[len(LOOKUP_PREFIX) :]))
        else:
            self._error(404, wire.NOT_FOUND_ERROR, "no_such_route", "no such route")

    def _read_body(self) -> bytes:
        """The body (by Content-Length); a body it cannot read ends the connection."""
        if "transfer-encoding" in self.fields:
            self.close_connection = True
            self._error(411, wire.INVALID_REQUEST, "length_required", "send a Content-Length")
            raise _Dropped
        try:
            length = int(self.fields.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._error(400, wire.INVALID_REQUEST, "bad_content_length", "bad Content-Length")
            raise _Dropped
        if length > MAX_BODY:
            self.close_connection = True
            self._error(413, wire.INVALID_REQUEST, "body_too_large", "request body too large")
            raise _Dropped
        body = self.rfile.read(length) if length else b""
        if len(body) < length:  # the client went away mid-body: nobody to answer
            self.close_connection = True
            raise _Dropped
        return body

    def _tenant(self) -> str | None:
        auth = self.fields.get(_AUTHORIZATION) or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.sim.ledger.tenant_for(token.strip())

    # -- the downstream API -------------------------------------------------------------

    def _submit(self, kind: Kind, path: str, raw: bytes) -> None:
        sim = self.sim
        tenant = self._tenant()
        if tenant is None:
            self._error(401, wire.AUTHENTICATION_ERROR, "invalid_api_key", "invalid API key")
            return
        key = (self.fields.get(_IDEMPOTENCY_KEY) or "").strip()
        if not key or len(key) > 255:
            self._error(
                400,
                wire.INVALID_REQUEST,
                "idempotency_key_missing",
                "Idempotency-Key header is required",
            )
            return
        number = sim.count_request("submit", tenant, key, self.fields.get(_DEADLINE))
        rule = sim.faults.pick("submit", tenant, kind.name, key, number)
        fault = rule.fault if rule else None
        if rule is not None and fault is Fault.RATE_LIMITED:
            sim.note_injected(fault)
            self._error(
                429,
                wire.RATE_LIMIT_ERROR,
                "rate_limited",
                "too many requests",
                {wire.RETRY_AFTER: rule.retry_after or "1"},
            )
            return
        if fault is Fault.UNAVAILABLE_BEFORE:
            sim.note_injected(fault)
            self._error(
                503, wire.API_ERROR, wire.NOT_PROCESSED, "unavailable; nothing was processed"
            )
            return
        if fault is Fault.RESET_BEFORE:
            sim.note_injected(fault)
            self._reset()
        try:
            params = _json(raw)
            kind.parse(params)
        except (ValueError, InvalidParams) as exc:
            code = exc.code if isinstance(exc, InvalidParams) else "body_not_json"
            self._error(400, wire.INVALID_REQUEST, code, "the request body is not a valid intent")
            return
        fp = fingerprint(path, params)
        if sim.switches.idempotency:
            with sim.idempotency_lock:
                record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
                if record is not None and record.fingerprint != fp:
                    self._error(
                        400,
                        wire.IDEMPOTENCY_ERROR,
                        wire.KEY_REUSED,
                        "this key was used with other parameters",
                    )
                    return
                if record is not None and record.state == "in_flight":
                    self._error(
                        409,
                        wire.IDEMPOTENCY_ERROR,
                        wire.KEY_IN_USE,
                        "a request with this key is still in progress",
                    )
                    return
                if record is None:
                    sim.ledger.begin(tenant, key, fp, sim.now())
            if record is not None and record.response is not None:
                self._answer(
                    rule,
                    replace(
                        record.response, headers={**record.response.headers, wire.REPLAYED: "true"}
                    ),
                )
                return
        if rule is not None and fault is Fault.HOLD_BEFORE_COMMIT:
            sim.note_injected(fault)
            sim.hold(self.connection, rule.hold_seconds or DEFAULT_HOLD_SECONDS)
        execution = sim.ledger.execute(
            tenant=tenant,
            kind=kind.name,
            key=key,
            fingerprint=fp,
            params=params,
            now=sim.now(),
            scripted=Scripted(
                refusal_code=(rule.code or "declined")
                if rule and fault is Fault.BUSINESS_REJECT
                else None,
                wrong_field=(rule.field or _default_field(kind))
                if rule and fault is Fault.MISMATCHED_RECEIPT
                else None,
                answer_503=fault is Fault.UNAVAILABLE_AFTER_COMMIT,
            ),
        )
        if fault is not None and fault in _CHANGE_EXECUTION:
            sim.note_injected(fault)
        self._answer(rule, execution.response)

    def _answer(self, rule: Rule | None, response: Response) -> None:
        """Send ``response``, unless the fault drops it after the commit."""
        if rule is not None and rule.fault in _ON_ANSWER:
            self.sim.note_injected(rule.fault)
        if rule is not None and rule.fault is Fault.COMMIT_THEN_TIMEOUT:
            # Answer late only when a test releases the hold; otherwise the client never hears.
            held = self.sim.hold(self.connection, rule.hold_seconds or DEFAULT_HOLD_SECONDS)
            if held != "released":
                self._reset()
        if rule is not None and rule.fault is Fault.COMMIT_THEN_RESET:
            self._reset()
        self._send(response.status, response.body, response.headers)

    def _lookup(self, key: str) -> None:
        sim = self.sim
        tenant = self._tenant()
        if tenant is None:
            self._error(401, wire.AUTHENTICATION_ERROR, "invalid_api_key", "invalid API key")
            return
        if not sim.switches.lookup:
            self._send(404, {}, {})  # no lookup API: a bare 404, not "key not found"
            return
        number = sim.count_request("lookup", tenant, key, self.fields.get(_DEADLINE))
        record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
        kind = record.outcome.get("object", "") if record and record.outcome else ""
        rule = sim.faults.pick("lookup", tenant, kind_of_object(str(kind)), key, number)
        if rule is not None and rule.fault is Fault.LOOKUP_UNAVAILABLE:
            sim.note_injected(rule.fault)
            self._error(503, wire.API_ERROR, "lookup_unavailable", "lookup is unavailable")
            return
        visible = (
            record is not None
            and record.outcome is not None
            and (sim.now() - record.created >= sim.switches.lookup_visibility_delay)
        )
        if record is None or record.outcome is None or not visible:
            self._error(404, wire.NOT_FOUND_ERROR, wire.KEY_NOT_FOUND, "no record of this key")
            return
        self._send(200, record.outcome, {})

    # -- control API (test mode only) ---------------------------------------------------

    def _control(self, method: str, route: str, raw: bytes) -> None:
        try:
            data = _json(raw) if raw else {}
            if not isinstance(data, dict):
                raise ValueError("body must be a JSON object")
            result = self._control_route(method, route, data)
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            # OverflowError: a number too large for a float or for the ledger's integers.
            self._error(400, wire.INVALID_REQUEST, "bad_control_request", str(exc))
            return
        if result is None:
            self._error(404, wire.NOT_FOUND_ERROR, "no_such_route", "no such route")
            return
        self._send(200, result, {})

    def _control_route(
        self, method: str, route: str, data: dict[str, Any]
    ) -> dict[str, Any] | None:
        sim = self.sim
        if (method, route) == ("POST", "reset"):
            sim.reset()
            return {"ok": True}
        if (method, route) == ("POST", "tenants"):
            sim.ledger.add_tenant(_str(data, "tenant"), _str(data, "api_key"))
            return {"ok": True}
        if (method, route) == ("POST", "orders"):
            status = data.get("status", "open")
            if status not in ("open", "closed"):
                raise ValueError("status must be open or closed")
            amount = data["amount_minor"]
            if not isinstance(amount, int) or amount <= 0:
                raise ValueError("amount_minor must be a positive integer")
            sim.ledger.create_order(
                _str(data, "tenant"), _str(data, "order_id"), amount, _str(data, "currency"), status
            )
            return {"ok": True}
        if (method, route) == ("POST", "rules"):
            return {"id": sim.faults.add_rule(_rule(data))}
        if (method, route) == ("DELETE", "rules"):
            sim.faults.clear()
            return {"ok": True}
        if (method, route) == ("GET", "faults"):
            return {**sim.faults.describe(), "injected": sim.injected()}
        if (method, route) == ("POST", "schedule"):
            sim.faults.set_schedule(_schedule(data))
            return {"ok": True}
        if (method, route) == ("DELETE", "schedule"):
            sim.faults.set_schedule(None)
            return {"ok": True}
        if route == "switches" and method in ("GET", "POST"):
            if method == "POST":
                sim.switches = replace(sim.switches, **_switches(data))
            return asdict(sim.switches)
        if (method, route) == ("POST", "clock"):
            seconds = data["advance_seconds"]
            if not isinstance(seconds, (int, float)):
                raise ValueError("advance_seconds must be a number")
            sim.advance_clock(float(seconds))
            return {"now": sim.now()}
        if (method, route) == ("POST", "release"):
            sim.release_holds()
            return {"ok": True}
        if (method, route) == ("GET", "ledger"):
            return {**sim.ledger.snapshot(), "requests": sim.requests(), "now": sim.now()}
        return None

    # -- low level ----------------------------------------------------------------------

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer a request the server cannot frame, and end the connection."""
        self.close_connection = True
        self._error(status, wire.INVALID_REQUEST, code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's error answer, as JSON like every other (its own is an HTML template)."""
        self._refuse(code, "http_error", message or self.responses.get(code, ("error",))[0])

    def _error(
        self,
        status: int,
        type_: str,
        code: str,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._send(
            status, {"error": {"type": type_, "code": code, "message": message}}, headers or {}
        )

    def _send(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str]) -> None:
        """Answer in one write: status line, header fields and body."""
        payload = json.dumps(body).encode()
        head = [
            f"{self.protocol_version} {status} {self.responses[status][0]}\r\n"
            f"Server: {self.version_string()}\r\n"
            f"Date: {_http_date(int(time.time()))}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
        ]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        if self.sim.stopping.is_set():
            self.close_connection = True
        if self.close_connection:
            head.append("Connection: close\r\n")
        elif self.request_version == "HTTP/1.0":
            head.append("Connection: keep-alive\r\n")
        head.append("\r\n")
        self.wfile.write("".join(head).encode("latin-1") + payload)
        if log.isEnabledFor(logging.DEBUG):
            self.log_request(status, len(payload))

    def _reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0, then close) and stop handling."""
        self._dropped = True
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The file objects hold references to the socket: close them first so the fd really closes.
        for stream in (self.rfile, self.wfile):
            with contextlib.suppress(OSError):
                stream.close()
        self.connection.close()
        raise _Dropped


@functools.lru_cache(maxsize=2)
def _http_date(second: int) -> str:
    return email.utils.formatdate(second, usegmt=True)


class _BadJSON(ValueError):
    """The body is not JSON the simulator can read."""


def _json(raw: bytes) -> Any:
    """The body as JSON; _BadJSON for anything else, nesting too deep to decode included
    (the decoder recurses: a 64 KiB body of "[" would end the thread without an answer)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _BadJSON("body is not JSON") from exc


def _default_field(kind: Kind) -> str:
    fields = list(kind.intent.model_fields)
    return "amount_minor" if "amount_minor" in fields else fields[-1]


def _str(data: Mapping[str, Any], name: str) -> str:
    value = data[name]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _opt(data: Mapping[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if value is not None and not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type")
    return value


def _switches(data: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(data) - set(Switches.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown switches: {sorted(unknown)}")
    for name in ("idempotency", "lookup"):
        if name in data and not isinstance(data[name], bool):
            raise ValueError(f"{name} must be true or false")
    for name in ("key_retention_seconds", "lookup_visibility_delay"):
        value = data.get(name, 0)
        if name == "key_retention_seconds" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number")
    return dict(data)


def _rule(data: Mapping[str, Any]) -> Rule:
    unknown = set(data) - set(Rule.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown rule fields: {sorted(unknown)}")
    times = _opt(data, "times", int)
    if times is not None and times < 1:
        raise ValueError("times must be at least 1")
    return Rule(
        fault=Fault(data["fault"]),
        pattern=_opt(data, "pattern", str) or "*",
        kind=_opt(data, "kind", str),
        tenant=_opt(data, "tenant", str),
        times=times,
        retry_after=_opt(data, "retry_after", str),
        hold_seconds=_opt(data, "hold_seconds", (int, float)),
        field=_opt(data, "field", str),
        code=_opt(data, "code", str),
    )


def _schedule(data: Mapping[str, Any]) -> Schedule:
    probabilities = data["probabilities"]
    if not isinstance(probabilities, dict):
        raise ValueError("probabilities must be an object")
    seed = data["seed"]
    if not isinstance(seed, int):
        raise ValueError("seed must be an integer")
    return Schedule(
        seed=seed,
        probabilities={Fault(name): float(p) for name, p in probabilities.items()},
        kind=_opt(data, "kind", str),
        tenant=_opt(data, "tenant", str),
        retry_after=_opt(data, "retry_after", str),
        hold_seconds=_opt(data, "hold_seconds", (int, float)),
    )


class SimulatorHandle:
    """A simulator serving in a background thread (tests, the demo)."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.sim = server.sim
        host, port = server.server_address[:2]
        self.host = host if isinstance(host, str) else host.decode()
        self.port = int(port)
        self.url = f"http://{self.host}:{self.port}"

    def open_connections(self) -> int:
        """How many client connections the server holds open (keep-alive ones included)."""
        return self._server.open_connections()

    def stop(self) -> None:
        """Stop serving, end held requests, join every handler thread, close the ledger."""
        self.sim.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self.sim.ledger.close()

    def __enter__(self) -> SimulatorHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve(
    host: str,
    port: int,
    ledger: str,
    test_mode: bool,
    tenants: Mapping[str, str] | None,
    idle_timeout: float = IDLE_TIMEOUT_SECONDS,
) -> _Server:
    book = Ledger(engine_for(ledger))
    for tenant, api_key in (tenants or {}).items():
        book.add_tenant(tenant, api_key)
    try:
        return _Server((host, port), Simulator(book, test_mode=test_mode), idle_timeout)
    except BaseException:
        book.close()
        raise


def start_in_thread(
    host: str = "127.0.0.1",
    port: int = 0,
    ledger: str = ":memory:",
    test_mode: bool = True,
    tenants: Mapping[str, str] | None = None,
    idle_timeout: float = IDLE_TIMEOUT_SECONDS,
) -> SimulatorHandle:
    """Serve in a daemon thread; ``port=0`` picks a free port (see ``handle.port``).

    ``idle_timeout``: how long a keep-alive connection may stay idle (see
    ``IDLE_TIMEOUT_SECONDS``; tests shorten it to see clients cope with a closed connection).
    """
    server = _serve(host, port, ledger, test_mode, tenants, idle_timeout)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="simulator", daemon=True
    )
    thread.start()
    return SimulatorHandle(server, thread)


def run(
    host: str,
    port: int,
    ledger: str,
    test_mode: bool,
    tenants: Mapping[str, str] | None = None,
) -> None:
    """Serve until interrupted (the ``settled simulator`` command); logs as ``outbox.logs``
    says (``SETTLED_LOG_LEVEL``, ``SETTLED_LOG_FORMAT``)."""
    logs.configure()
    server = _serve(host, port, ledger, test_mode, tenants)
    log.info(
        "simulator listening",
        extra={"host": host, "port": server.server_address[1], "test_mode": test_mode},
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.sim.stopping.set()
        server.server_close()
        server.sim.ledger.close()
