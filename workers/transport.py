"""The network under the HTTP adapters: no byte of a request leaves after its attempt's bound.

httpcore times each phase from the phase's own start (connect, TLS, every read, every write)
and runs ``getaddrinfo`` inside its connect with no timeout at all. Per-phase timeouts, even
each set to what is left when its phase begins, let a request be written after its bound: a
resolver answering late, a TLS handshake held by a slow network (the write that followed was
given 1 ms, in which a local write succeeds), a process stopped inside its HTTP call, an answer
trickling one byte per read timeout. ``BoundedBackend`` holds the bound of the request being
made (``bound_request``, set by the gateway around each request, per thread and per request,
never shared) and:

- resolves names in a worker thread, waited for with what is left (late: not sent, ``resolve``);
- gives the TCP connect and the TLS handshake what is left of the whole attempt;
- checks the bound immediately before the request's first byte, on a new connection and on a
  pooled keep-alive one alike, and refuses to write once it has passed (not sent, ``write``);
- bounds every later read and write by what is left (after the first byte: maybe sent);
- sets ``TCP_USER_TIMEOUT`` to what is left, so the kernel gives up instead of delivering the
  request by retransmission after the bound.

A check cannot stop a process that stalls between it and the write (DESIGN.md, "Concurrency and
crashes"): what covers that is the downstream's fence (``Settled-Deadline``) or the contract's
delay bound. This module narrows the window from whole phases to a few instructions.

Errors::

    httpx.TransportError
     └── NotSentError      nothing of the request left; .phase and .detail say where and why
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import queue
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from outbox.clock import Deadline
from outbox.downstream import NotSent, SendPhase

#: How names are resolved: ``socket.getaddrinfo``'s shape, called as
#: ``resolver(host, port, 0, socket.SOCK_STREAM)``; injectable for tests.
Resolver = Callable[[str, int, int, int], Sequence[tuple[Any, ...]]]
#: Called immediately before the bound is checked for a request's first byte (tests stall or
#: stop the process there).
Hook = Callable[[], None]


class NotSentError(httpx.TransportError):
    """Nothing of the request left this process."""

    def __init__(self, phase: SendPhase, detail: str) -> None:
        super().__init__(f"not sent ({phase.value}): {detail}")
        self.phase = phase
        self.detail = detail


#: Nothing left the client: the request provably never reached the downstream.
NOT_SENT_ERRORS = (NotSentError, httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def not_sent(exc: BaseException) -> NotSent | None:
    """The outcome an error proves when nothing of the request left (None: it may have)."""
    if isinstance(exc, NotSentError):
        return NotSent(exc.detail, exc.phase)
    if isinstance(exc, httpx.PoolTimeout):
        return NotSent(error_name(exc), SendPhase.POOL)
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return NotSent(error_name(exc), SendPhase.CONNECT)
    return None


def error_name(exc: BaseException) -> str:
    """A transport error as an outcome's detail and the log name it: its class's name, or what
    a ``NotSentError`` says."""
    return exc.detail if isinstance(exc, NotSentError) else type(exc).__name__


def user_timeout_ms(left: float) -> int:
    """``TCP_USER_TIMEOUT`` for ``left`` seconds: whole milliseconds, never past the bound,
    at least 1 (0 would mean the system's default, about 15 minutes)."""
    return max(1, int(left * 1000))


@dataclass
class _Request:
    deadline: Deadline
    #: the request's first byte was handed to the kernel: from now on, maybe sent
    wrote: bool = False


_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "settled_request_bound", default=None
)


@contextlib.contextmanager
def bound_request(deadline: Deadline) -> Iterator[None]:
    """Bound the one request this thread makes inside the block, its answer included, by
    ``deadline`` (a contextvar: each thread, each request its own)."""
    token = _current.set(_Request(deadline))
    try:
        yield
    finally:
        _current.reset(token)


def _left(timeout: float | None) -> float | None:
    """What a phase may take: httpcore's ``timeout`` for it, never more than what is left of
    the request's bound (httpcore's own where no bound is set)."""
    request = _current.get()
    if request is None:
        return timeout
    left = request.deadline.left()
    return left if timeout is None else min(timeout, left)


def _passed(left: float | None) -> bool:
    return left is not None and left <= 0


def _limit_retransmission(stream: httpcore.NetworkStream, left: float | None) -> None:
    # A write returns once the kernel holds the bytes; a network that drops them has the kernel
    # retransmit them for up to ~15 minutes (tcp_retries2), so a request written inside its
    # bound could still land long after it. TCP_USER_TIMEOUT (Linux) makes the kernel give up
    # and reset the connection once sent data stays unacknowledged for that long.
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = stream.get_extra_info("socket")
    if option is None or left is None or not isinstance(sock, socket.socket):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, user_timeout_ms(left))


class BoundedStream(httpcore.NetworkStream):
    """A connection whose every operation ends by the bound of the request using it."""

    def __init__(self, inner: httpcore.NetworkStream, before_first_byte: Hook | None) -> None:
        self._inner = inner
        self._before_first_byte = before_first_byte

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        left = _left(timeout)
        if _passed(left):  # after the first byte: maybe sent
            raise httpcore.ReadTimeout("the request's bound passed")
        return self._inner.read(max_bytes, left)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        request = _current.get()
        if request is not None and not request.wrote:
            if self._before_first_byte is not None:
                self._before_first_byte()
            _limit_retransmission(self._inner, request.deadline.left())
            remaining = request.deadline.left()
            if remaining <= 0:
                raise NotSentError(SendPhase.WRITE, "deadline passed before the first byte")
            request.wrote = True
            self._inner.write(buffer, remaining if timeout is None else min(timeout, remaining))
            return
        left = _left(timeout)
        if _passed(left):  # the rest of a request whose first bytes left: maybe sent
            raise httpcore.WriteTimeout("the request's bound passed")
        self._inner.write(buffer, left)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout)
        if _passed(left):
            self._inner.close()
            raise NotSentError(SendPhase.TLS, "ConnectTimeout")
        # Python bounds the whole handshake by the socket's timeout (not each of its reads),
        # so the handshake ends by the bound.
        try:
            tls = self._inner.start_tls(ssl_context, server_hostname, left)
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
            raise NotSentError(SendPhase.TLS, type(exc).__name__) from exc
        return BoundedStream(tls, self._before_first_byte)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class BoundedBackend(httpcore.NetworkBackend):
    """httpcore's network, each phase bounded by what is left of the request's bound."""

    def __init__(
        self,
        *,
        resolver: Resolver = socket.getaddrinfo,
        before_first_byte: Hook | None = None,
    ) -> None:
        self._resolver = resolver
        self._before_first_byte = before_first_byte
        self._tcp = httpcore.SyncBackend()  # connects to an address, never resolves here

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        failed: Exception | None = None
        for address in self._resolve(host, port, timeout):
            left = _left(timeout)
            if _passed(left):
                raise NotSentError(SendPhase.CONNECT, "ConnectTimeout") from failed
            try:
                stream = self._tcp.connect_tcp(
                    address,
                    port,
                    timeout=left,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc  # the next address, as socket.create_connection does
                continue
            _limit_retransmission(stream, _left(timeout))
            return BoundedStream(stream, self._before_first_byte)
        detail = type(failed).__name__ if failed is not None else "ConnectError"
        raise NotSentError(SendPhase.CONNECT, detail) from failed

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        raise NotSentError(SendPhase.CONNECT, "unix sockets are not supported")

    def _resolve(self, host: str, port: int, timeout: float | None) -> list[str]:
        """The addresses of ``host``, in the resolver's order, answered within the bound."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            return [host]  # an address already: nothing to resolve
        answer: queue.SimpleQueue[Sequence[tuple[Any, ...]] | Exception] = queue.SimpleQueue()

        def ask() -> None:
            try:
                answer.put(self._resolver(host, port, 0, socket.SOCK_STREAM))
            except Exception as exc:  # an answer too: the name does not resolve
                answer.put(exc)

        # getaddrinfo cannot be timed out: it runs in a thread of its own, which a late answer
        # leaves behind (it ends when the resolver answers, and nobody reads that answer).
        threading.Thread(target=ask, name="settled-resolve", daemon=True).start()
        try:
            got = answer.get(timeout=_left(timeout))
        except queue.Empty:
            raise NotSentError(SendPhase.RESOLVE, "ResolveTimeout") from None
        if isinstance(got, Exception):
            raise NotSentError(SendPhase.RESOLVE, "ConnectError") from got
        addresses = list(dict.fromkeys(str(info[4][0]) for info in got))
        if not addresses:
            raise NotSentError(SendPhase.RESOLVE, "ConnectError")
        return addresses


class BoundedTransport(httpx.HTTPTransport):
    """httpx's HTTP transport over ``BoundedBackend``: a request made inside
    ``bound_request`` sends nothing after its bound. Never retries."""

    def __init__(
        self,
        *,
        limits: httpx.Limits | None = None,
        verify: ssl.SSLContext | bool = True,
        resolver: Resolver = socket.getaddrinfo,
        before_first_byte: Hook | None = None,
    ) -> None:
        limits = limits or httpx.Limits()
        ssl_context = httpx.create_ssl_context(verify=verify)  # SSL_CERT_FILE is honoured
        super().__init__(verify=ssl_context, limits=limits, retries=0)
        # httpx takes no network backend: the pool is built again as HTTPTransport builds it
        # (same context and limits, HTTP/1.1, no retries), over the bounded backend.
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            retries=0,
            network_backend=BoundedBackend(resolver=resolver, before_first_byte=before_first_byte),
        )
