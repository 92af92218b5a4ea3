"""The bounded transport's rules, on a stream in memory and a clock the test moves: what an
error proves, the first-byte check, and every later operation ended by the request's bound; and
the backend's resolving and connecting, over a resolver and sockets in the test's hands."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpcore
import httpx
import pytest

from outbox.clock import Deadline
from outbox.downstream import NotSent, SendPhase
from tests.support.gateways import FakeMonotonic
from workers.transport import (
    BoundedBackend,
    BoundedStream,
    BoundedTransport,
    NotSentError,
    bound_request,
    error_name,
    not_sent,
    user_timeout_ms,
)


class MemoryStream(httpcore.NetworkStream):
    """A connection in memory: records what was written, with the timeout each call got."""

    def __init__(self, tls_error: Exception | None = None) -> None:
        self.writes: list[tuple[bytes, float | None]] = []
        self.reads: list[float | None] = []
        self.tls: list[float | None] = []
        self.tls_error = tls_error
        self.closed = False

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self.reads.append(timeout)
        return b"x"

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append((buffer, timeout))

    def close(self) -> None:
        self.closed = True

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        self.tls.append(timeout)
        if self.tls_error is not None:
            raise self.tls_error
        return self


class Hook:
    def __init__(self, clock: FakeMonotonic, jump: float = 0.0) -> None:
        self.clock, self.jump, self.calls = clock, jump, 0

    def __call__(self) -> None:
        self.calls += 1
        self.clock.advance(self.jump)


def deadline(clock: FakeMonotonic, seconds: float) -> Deadline:
    return Deadline(datetime.now(UTC) + timedelta(seconds=seconds), clock() + seconds, clock)


@pytest.mark.parametrize(
    ("left", "ms"), [(0.0, 1), (0.0004, 1), (0.0019, 1), (1.5, 1500), (2.9999, 2999)]
)
def test_the_kernels_timeout_is_whole_milliseconds_never_past_the_bound_never_zero(
    left: float, ms: int
) -> None:
    assert user_timeout_ms(left) == ms


@pytest.mark.parametrize(
    ("error", "proved"),
    [
        (NotSentError(SendPhase.RESOLVE, "ResolveTimeout"), NotSent("ResolveTimeout", "resolve")),
        (NotSentError(SendPhase.WRITE, "late"), NotSent("late", SendPhase.WRITE)),
        (httpx.PoolTimeout("busy"), NotSent("PoolTimeout", SendPhase.POOL)),
        (httpx.ConnectError("refused"), NotSent("ConnectError", SendPhase.CONNECT)),
        (httpx.ConnectTimeout("slow"), NotSent("ConnectTimeout", SendPhase.CONNECT)),
        (httpx.ReadTimeout("slow"), None),
        (httpx.WriteTimeout("slow"), None),
        (httpx.WriteError("reset"), None),
        (httpx.RemoteProtocolError("cut"), None),
        (ValueError("a bug"), None),
    ],
)
def test_only_errors_before_the_first_byte_prove_not_sent(
    error: Exception, proved: NotSent | None
) -> None:
    assert not_sent(error) == proved


def test_a_not_sent_error_is_named_by_what_it_says() -> None:
    assert error_name(NotSentError(SendPhase.TLS, "ConnectTimeout")) == "ConnectTimeout"
    assert error_name(httpx.ReadTimeout("x")) == "ReadTimeout"
    assert NotSentError(SendPhase.TLS, "x").phase is SendPhase.TLS


def test_outside_a_bound_the_stream_keeps_httpcores_timeouts() -> None:
    inner = MemoryStream()
    stream = BoundedStream(inner, None)
    stream.write(b"GET", timeout=7.0)
    stream.read(10, timeout=8.0)
    assert inner.writes == [(b"GET", 7.0)] and inner.reads == [8.0]


def test_the_first_byte_after_the_bound_is_refused_and_nothing_is_written() -> None:
    clock = FakeMonotonic()
    hook = Hook(clock, jump=6.0)  # stalled right before the first byte, past the bound
    inner = MemoryStream()
    stream = BoundedStream(inner, hook)
    with bound_request(deadline(clock, 5.0)), pytest.raises(NotSentError) as refused:
        stream.write(b"POST /v1/refunds", timeout=5.0)
    assert refused.value.phase is SendPhase.WRITE
    assert hook.calls == 1 and inner.writes == []


def test_after_the_first_byte_every_operation_ends_by_the_bound_and_proves_nothing() -> None:
    clock = FakeMonotonic()
    inner = MemoryStream()
    stream = BoundedStream(inner, Hook(clock))
    with bound_request(deadline(clock, 5.0)):
        stream.write(b"headers", timeout=9.0)
        clock.advance(2.0)
        stream.read(10, timeout=9.0)  # httpcore's per-read timeout: cut to what is left
        clock.advance(3.0)
        with pytest.raises(httpcore.WriteTimeout):  # maybe sent: the headers left
            stream.write(b"body", timeout=9.0)
        with pytest.raises(httpcore.ReadTimeout):
            stream.read(10, timeout=9.0)
    assert inner.writes == [(b"headers", 5.0)]
    assert inner.reads == [3.0]


def test_every_request_on_a_kept_alive_connection_is_checked_before_its_first_byte() -> None:
    clock = FakeMonotonic()
    hook = Hook(clock)
    inner = MemoryStream()
    stream = BoundedStream(inner, hook)  # one connection, two requests
    with bound_request(deadline(clock, 5.0)):
        stream.write(b"first", timeout=None)
        stream.write(b"first's body", timeout=None)
    with bound_request(deadline(clock, 1.0)):
        hook.jump = 2.0
        with pytest.raises(NotSentError):
            stream.write(b"second", timeout=None)
    assert hook.calls == 2
    assert [data for data, _ in inner.writes] == [b"first", b"first's body"]


def test_the_handshake_gets_what_is_left_of_the_whole_attempt() -> None:
    clock = FakeMonotonic()
    inner = MemoryStream()
    stream = BoundedStream(inner, None)
    with bound_request(deadline(clock, 5.0)):
        clock.advance(4.0)  # the name and the connect took most of it
        tls = stream.start_tls(ssl.create_default_context(), "example.test", timeout=5.0)
    assert inner.tls == [1.0]
    assert isinstance(tls, BoundedStream)


def test_a_handshake_after_the_bound_is_not_started() -> None:
    clock = FakeMonotonic()
    inner = MemoryStream()
    stream = BoundedStream(inner, None)
    with bound_request(deadline(clock, 1.0)):
        clock.advance(1.0)
        with pytest.raises(NotSentError) as refused:
            stream.start_tls(ssl.create_default_context(), "example.test", timeout=5.0)
    assert refused.value.phase is SendPhase.TLS
    assert inner.tls == [] and inner.closed


def test_a_handshake_that_fails_is_not_sent_in_the_tls_phase() -> None:
    clock = FakeMonotonic()
    inner = MemoryStream(tls_error=httpcore.ConnectTimeout("held"))
    stream = BoundedStream(inner, None)
    with bound_request(deadline(clock, 1.0)), pytest.raises(NotSentError) as refused:
        stream.start_tls(ssl.create_default_context(), "example.test", timeout=5.0)
    assert (refused.value.phase, refused.value.detail) == (SendPhase.TLS, "ConnectTimeout")


def test_the_bounded_transport_keeps_the_limits_it_is_given() -> None:
    # the pool is built again over the bounded backend: the caller's limits must reach it
    # (a worker's pool size and keep-alive expiry are set to fit the downstream's idle timeout)
    limits = httpx.Limits(max_connections=3, max_keepalive_connections=2, keepalive_expiry=1.5)
    transport = BoundedTransport(limits=limits)
    pool = transport._pool
    assert (pool._max_connections, pool._max_keepalive_connections) == (3, 2)
    assert pool._keepalive_expiry == 1.5
    transport.close()


def test_outside_a_bound_and_without_a_timeout_nothing_is_bounded() -> None:
    # httpcore passes None for a phase without a timeout: no bound, and no error either
    inner = MemoryStream()
    stream = BoundedStream(inner, None)
    stream.write(b"GET")
    stream.read(10)
    stream.start_tls(ssl.create_default_context(), "example.test")
    assert inner.writes == [(b"GET", None)] and inner.reads == [None] and inner.tls == [None]


def test_an_empty_write_is_no_first_byte() -> None:
    """httpcore writes b"" for an event with nothing to send: nothing leaves, so it is not the
    request's first byte (the hook is not run, the request is still unsent)."""
    clock = FakeMonotonic()
    hook = Hook(clock, jump=6.0)
    inner = MemoryStream()
    stream = BoundedStream(inner, hook)
    with bound_request(deadline(clock, 5.0)):
        stream.write(b"", timeout=5.0)
        assert inner.writes == [] and hook.calls == 0
        with pytest.raises(NotSentError):  # the real first byte is still checked
            stream.write(b"POST /v1/refunds", timeout=5.0)
    assert inner.writes == []


class SocketStream(MemoryStream):
    """A stream in memory over a real (unconnected) socket: the kernel's options are set."""

    def __init__(self) -> None:
        super().__init__()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def get_extra_info(self, info: str) -> Any:
        return self.sock if info == "socket" else None


def test_a_system_without_tcp_user_timeout_sends_as_usual(monkeypatch: pytest.MonkeyPatch) -> None:
    """TCP_USER_TIMEOUT is Linux's: elsewhere the kernel is not told, and the request goes."""
    monkeypatch.delattr(socket, "TCP_USER_TIMEOUT", raising=False)
    clock = FakeMonotonic()
    inner = SocketStream()
    try:
        with bound_request(deadline(clock, 5.0)):
            BoundedStream(inner, None).write(b"POST /v1/refunds", timeout=5.0)
    finally:
        inner.sock.close()
    assert inner.writes == [(b"POST /v1/refunds", 5.0)]


# -- the backend: resolving and connecting --------------------------------------------------


class Resolver:
    """A name server in the test's hands: records each question and the thread asking it;
    answers ``answer`` (or raises it); with ``hang``, answers only once ``release`` is set."""

    def __init__(self, answer: object = None, hang: bool = False) -> None:
        self.answer = answer if answer is not None else [(2, 1, 6, "", ("10.0.0.1", 443))]
        self.hang = hang
        self.release = threading.Event()
        self.questions: list[tuple[str, int, int, int]] = []
        self.threads: list[threading.Thread] = []

    def __call__(self, host: str, port: int, family: int, kind: int) -> Sequence[tuple[Any, ...]]:
        self.questions.append((host, port, family, kind))
        self.threads.append(threading.current_thread())
        if self.hang:
            self.release.wait(10)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer  # type: ignore[return-value]


class Tcp(httpcore.NetworkBackend):
    """Connects to nothing: each address fails with its error in ``errors`` (its clock moved
    by ``takes`` first), or connects to a stream in memory."""

    def __init__(self, clock: FakeMonotonic, errors: dict[str, Exception], takes: float = 0.0):
        self.clock, self.errors, self.takes = clock, errors, takes
        self.tried: list[str] = []

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        self.tried.append(host)
        self.clock.advance(self.takes)
        if host in self.errors:
            raise self.errors[host]
        return MemoryStream()


def two_addresses(port: int = 443) -> list[tuple[Any, ...]]:
    return [(2, 1, 6, "", ("10.0.0.1", port)), (2, 1, 6, "", ("10.0.0.2", port))]


def backend_over(tcp: Tcp, resolver: Resolver) -> BoundedBackend:
    backend = BoundedBackend(resolver=resolver)
    backend._tcp = tcp  # the sockets underneath, in the test's hands
    return backend


def test_a_name_is_asked_for_every_address_family_and_stream_sockets() -> None:
    clock = FakeMonotonic()
    resolver = Resolver(two_addresses())
    backend = backend_over(Tcp(clock, {}), resolver)
    with bound_request(deadline(clock, 5.0)):
        backend.connect_tcp("refunds.example.test", 443, timeout=5.0)
    # AF_UNSPEC: IPv4 and IPv6 answers alike, as socket.create_connection asks
    assert resolver.questions == [
        ("refunds.example.test", 443, socket.AF_UNSPEC, socket.SOCK_STREAM)
    ]


def test_a_hung_resolver_is_bounded_by_the_request_and_keeps_no_process_alive() -> None:
    """getaddrinfo cannot be interrupted: it is left behind in a daemon thread, and the
    request is not sent (resolve) when its bound ends."""
    clock = FakeMonotonic()
    resolver = Resolver(hang=True)
    tcp = Tcp(clock, {})
    backend = backend_over(tcp, resolver)
    try:
        with bound_request(deadline(clock, 0.05)), pytest.raises(NotSentError) as refused:
            backend.connect_tcp("refunds.example.test", 443, timeout=5.0)
        assert (refused.value.phase, refused.value.detail) == (SendPhase.RESOLVE, "ResolveTimeout")
        assert tcp.tried == []
        (thread,) = resolver.threads
        assert thread.is_alive() and thread.daemon  # the interpreter exits past it
    finally:
        resolver.release.set()


@pytest.mark.parametrize(
    "answer",
    [socket.gaierror(socket.EAI_NONAME, "Name or service not known"), []],
    ids=["does-not-resolve", "no-address"],
)
def test_a_name_without_an_address_is_not_sent_in_the_resolve_phase(answer: object) -> None:
    clock = FakeMonotonic()
    tcp = Tcp(clock, {})
    backend = backend_over(tcp, Resolver(answer))
    with bound_request(deadline(clock, 5.0)), pytest.raises(NotSentError) as refused:
        backend.connect_tcp("refunds.example.test", 443, timeout=5.0)
    assert (refused.value.phase, refused.value.detail) == (SendPhase.RESOLVE, "ConnectError")
    assert tcp.tried == []
    if isinstance(answer, Exception):
        assert refused.value.__cause__ is answer


def test_no_address_is_tried_once_the_bound_has_passed() -> None:
    """The first address took the rest of the bound to fail: the next one is not tried."""
    clock = FakeMonotonic()
    tcp = Tcp(clock, {"10.0.0.1": httpcore.ConnectError("refused")}, takes=6.0)
    backend = backend_over(tcp, Resolver(two_addresses()))
    with bound_request(deadline(clock, 5.0)), pytest.raises(NotSentError) as refused:
        backend.connect_tcp("refunds.example.test", 443, timeout=5.0)
    assert (refused.value.phase, refused.value.detail) == (SendPhase.CONNECT, "ConnectTimeout")
    assert tcp.tried == ["10.0.0.1"]


@pytest.mark.parametrize(
    ("last", "detail"),
    [
        (httpcore.ConnectTimeout("slow"), "ConnectTimeout"),
        (httpcore.ConnectError("no"), "ConnectError"),
    ],
)
def test_every_address_failing_is_not_sent_named_by_the_last_failure(
    last: Exception, detail: str
) -> None:
    clock = FakeMonotonic()
    errors = {"10.0.0.1": httpcore.ConnectError("refused"), "10.0.0.2": last}
    tcp = Tcp(clock, errors)
    backend = backend_over(tcp, Resolver(two_addresses()))
    with bound_request(deadline(clock, 5.0)), pytest.raises(NotSentError) as refused:
        backend.connect_tcp("refunds.example.test", 443, timeout=5.0)
    assert (refused.value.phase, refused.value.detail) == (SendPhase.CONNECT, detail)
    assert refused.value.__cause__ is last
    assert tcp.tried == ["10.0.0.1", "10.0.0.2"]
