"""The simulator's HTTP/1.1 server: connections, request heads and bodies, answers.

Connections are HTTP/1.1 keep-alive: a connection, and the thread that serves it, carries request
after request, so a submit costs no connect and no thread start. Clients do not pipeline (the
next request leaves after the answer), so a reset still hits exactly one request, the one in
flight on the connection. Request heads are parsed by a small reader and each answer goes out in
one write. A request the server cannot frame is answered (in JSON, like every answer) and ends
its connection.

The application behind the server answers a ``Request`` with a ``Response``; through the
``Connection`` it is handed it may reset the connection instead, or watch whether the client
hung up.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import json
import logging
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn, Protocol

from outbox import wire
from settled.simulator.messages import Connection, Request, Response, error

# The simulator logs under one name (its request notes included), as before the split.
log = logging.getLogger("settled.simulator.server")

MAX_BODY = 64 * 1024
MAX_LINE = 65536
MAX_HEADERS = 100
METHODS = frozenset({"GET", "POST", "DELETE"})
#: How long a keep-alive connection may sit idle (or a read or write stall) before the server
#: closes it. It must stay well above the clients' keep-alive expiry (HttpGateway's
#: ``KEEPALIVE_EXPIRY_SECONDS``, httpx's default 5 s): a client then always drops an idle
#: connection before the server does, and practically never sends a request on a connection the
#: server is closing. (Should that race happen anyway, the client sees a read error, which it
#: classifies as "maybe sent": safe, the executor then looks the key up, never re-sends.)
IDLE_TIMEOUT_SECONDS = 20.0


class Application(Protocol):
    """What the server serves."""

    def respond(self, request: Request, connection: Connection) -> Response:
        """The answer to ``request``; ``connection.reset()`` drops the request instead."""
        ...

    def route_of(self, path: str) -> str:
        """``path`` as the request log may show it."""
        ...


class HttpServer(ThreadingHTTPServer):
    """Serves ``app``, a thread per connection; ``stopping`` set: every answer closes its
    connection."""

    daemon_threads = False  # join handler threads on close: no thread outlives stop()
    block_on_close = True
    # The listen backlog (socketserver's default is 5): a batch opens its connections all at
    # once, and a connect dropped from a full backlog is retried only a second later.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        app: Application,
        *,
        stopping: threading.Event,
        idle_timeout: float = IDLE_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        #: the server's clock (the simulator's, which a test may set off): every answer says it
        #: (``Date``, and ``Settled-Server-Time`` in the wire protocol's answers), and the
        #: deadline fence reads the same clock
        self.clock = clock
        self.stopping = stopping
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
        """How many client connections the server holds open (keep-alive ones included)."""
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
    """The connection was closed without an answer (a reset, or a body that never came)."""


class _Handler(BaseHTTPRequestHandler):
    """One connection: reads request after request, answers each, and is the application's
    ``Connection`` while it works on one."""

    server: HttpServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # an answer is one write; send it at once
    _dropped = False
    path = ""  # until a request line is read
    #: the request's header fields, by lower-case name (the first of repeated fields)
    fields: dict[str, str]

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)

    def handle(self) -> None:
        with contextlib.suppress(_Dropped):
            super().handle()

    def finish(self) -> None:
        if not self._dropped:
            super().finish()

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
            if not self._read_head(line):
                return
            if self.command not in METHODS:
                self._refuse(501, "unsupported_method", "unsupported method")
                return
            body = self._read_body()
            path, _, query = self.path.partition("?")
            request = Request(self.command, path, self.fields, body, query)
            self._send(self.server.app.respond(request, self))
        except TimeoutError:
            self.close_connection = True  # idle past the idle timeout, or a stalled transfer

    # -- reading ------------------------------------------------------------------------

    def _read_head(self, request_line: bytes) -> bool:
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

    def _read_body(self) -> bytes:
        """The body (by Content-Length); a body it cannot read ends the connection."""
        if "transfer-encoding" in self.fields:
            self._refuse(411, "length_required", "send a Content-Length")
            raise _Dropped
        try:
            length = int(self.fields.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._refuse(400, "bad_content_length", "bad Content-Length")
            raise _Dropped
        if length > MAX_BODY:
            self._refuse(413, "body_too_large", "request body too large")
            raise _Dropped
        body = self.rfile.read(length) if length else b""
        if len(body) < length:  # the client went away mid-body: nobody to answer
            self.close_connection = True
            raise _Dropped
        return body

    # -- the application's Connection ---------------------------------------------------

    def peer_closed(self) -> bool:
        """Whether the client hung up (its end is closed, or the socket failed)."""
        connection: socket.socket = self.connection
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            if not readable:
                return False
            return connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def reset(self) -> NoReturn:
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

    # -- answering ----------------------------------------------------------------------

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer a request the server cannot frame, and end the connection."""
        self.close_connection = True
        self._send(error(status, wire.INVALID_REQUEST, code, message))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's error answer, as JSON like every other (its own is an HTML template)."""
        self._refuse(code, "http_error", message or self.responses.get(code, ("error",))[0])

    def _send(self, response: Response) -> None:
        """Answer in one write: status line, header fields and body."""
        status = response.status
        payload = json.dumps(response.body).encode()
        now = self.server.clock()
        said = wire.format_deadline(datetime.fromtimestamp(now, UTC))
        head = [
            f"{self.protocol_version} {status} {self.responses[status][0]}\r\n"
            f"Server: {self.version_string()}\r\n"
            f"Date: {_http_date(int(now))}\r\n"
            + (f"{wire.SERVER_TIME}: {said}\r\n" if response.server_time else "")
            + "Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
        ]
        head += [f"{name}: {value}\r\n" for name, value in response.headers.items()]
        if self.server.stopping.is_set():
            self.close_connection = True
        if self.close_connection:
            head.append("Connection: close\r\n")
        elif self.request_version == "HTTP/1.0":
            head.append("Connection: keep-alive\r\n")
        head.append("\r\n")
        if response.pace is None:
            self.wfile.write("".join(head).encode("latin-1") + payload)
        else:
            self._trickle("".join(head).encode("latin-1"), payload, response.pace)
        if log.isEnabledFor(logging.DEBUG):
            self.log_request(status, len(payload))

    def _trickle(self, head: bytes, payload: bytes, pace: float) -> None:
        """The ``slow_body`` fault: the head at once, then the body a byte at a time, a pause of
        ``pace`` seconds before each, until it is written, the client goes or the server stops
        (a client that went ends the connection)."""
        self.wfile.write(head)
        self.wfile.flush()
        for i in range(len(payload)):
            if self.server.stopping.wait(pace) or self.peer_closed():
                self.close_connection = True
                return
            try:
                self.wfile.write(payload[i : i + 1])
                self.wfile.flush()
            except OSError:
                self.close_connection = True
                return

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)  # http.server's own notes (errors); never the client address

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = self.server.app.route_of(self.path.split("?", 1)[0])
        log.debug("request", extra={"method": self.command, "path": path[:200], "status": code})


@functools.lru_cache(maxsize=2)
def _http_date(second: int) -> str:
    return email.utils.formatdate(second, usegmt=True)
