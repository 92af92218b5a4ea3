"""No byte of a request leaves after its attempt's bound (``workers.transport``).

Each test holds one phase of a real attempt past its bound (a resolver answering late, a TLS
handshake held until after the deadline, a sender stalled or stopped with SIGSTOP right before
its first byte, a Stripe answer trickling one byte at a time), and the judge is what reached the
server: a plain socket server that records every byte each connection sent, or the simulator's
ledger. Nothing sent proves "not sent"; an answer that bytes left for ends at the deadline as
"unknown", never later.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpcore
import pytest
from pydantic import SecretStr

from outbox.clock import Deadline
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    NotSent,
    SendPhase,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import State
from settled.simulator import SimulatorControl, SimulatorHandle
from settled.simulator.proxy import FaultProxy
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from tests.support.gateways import FakeMonotonic
from tests.support.rig import GOOD, Rig
from tests.support.simtools import SimTenant, wait_until
from workers.http_client import HttpGateway
from workers.stripe_gateway import StripeGateway
from workers.transport import BoundedBackend, BoundedTransport, bound_request

REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1", "amount_minor": 2500, "currency": "CNY", "payee": "P1"}
KEYS = {"acme": SecretStr("sk_test_acme_4f1c9a7e")}
#: The name the tests' resolvers answer for (with 127.0.0.1).
HOST = "settled-downstream.test"
#: How far past its deadline an attempt may end on a loaded machine (a correctness bound).
SLACK = 1.5


def submit(
    gateway: HttpGateway | StripeGateway, deadline: Deadline | datetime, key: str = "k1"
) -> SubmitOutcome:
    return gateway.submit(DownstreamRequest("acme", "op-1", REFUND, key, PARAMS), deadline=deadline)


def in_seconds(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


class Recorder:
    """A TCP server that never answers and records every byte each connection sent, until the
    client closes it. With ``tls``, it holds each TLS handshake until ``hold_until``
    (monotonic) and then completes it, recording what came after (the request, decrypted)."""

    def __init__(self, tls: ssl.SSLContext | None = None, hold_until: float = 0.0) -> None:
        self._tls = tls
        self.hold_until = hold_until
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.02)
        self.port: int = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.accepted = 0
        #: what each finished connection sent (its request bytes), in the order they closed
        self.received: list[bytes] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def url(self, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}"

    def all_bytes(self) -> bytes:
        with self._lock:
            return b"".join(self.received)

    def finished(self) -> int:
        with self._lock:
            return len(self.received)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.accepted += 1
            thread = threading.Thread(target=self._record, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _record(self, conn: socket.socket) -> None:
        got = b""
        try:
            if self._tls is not None:
                if self._stopping.wait(max(0.0, self.hold_until - time.monotonic())):
                    return
                conn.settimeout(5)
                conn = self._tls.wrap_socket(conn, server_side=True)
            conn.settimeout(5)
            while chunk := conn.recv(65536):
                got += chunk
        except (OSError, ssl.SSLError):
            pass  # the client gave up: what it sent until then is what counts
        finally:
            conn.close()
            with self._lock:
                self.received.append(got)

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._listener.close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.stop()


class SlowResolver:
    """Answers ``HOST`` with 127.0.0.1 after ``delay`` seconds (a slow name server), or as soon
    as ``release`` is called; counts the questions."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.released = threading.Event()
        self.answered = threading.Event()
        self.asked = 0

    def __call__(self, host: str, port: int, family: int, kind: int) -> Sequence[tuple[Any, ...]]:
        self.asked += 1
        self.released.wait(self.delay)  # the name server's latency
        try:
            return socket.getaddrinfo("127.0.0.1", port, socket.AF_INET, kind)
        finally:
            self.answered.set()

    def release(self) -> None:
        self.released.set()


def http_gateway(
    url: str, keys: dict[str, SecretStr] | None = None, **transport: Any
) -> HttpGateway:
    """A wire-protocol gateway over the bounded transport (``transport``: its arguments)."""
    return HttpGateway(url, keys or KEYS, timeout=10.0, transport=BoundedTransport(**transport))


# -- resolve -----------------------------------------------------------------------------


def test_a_resolver_answering_after_the_deadline_is_not_sent_and_nothing_connects(
    recorder: Recorder,
) -> None:
    resolver = SlowResolver(delay=3.0)
    with http_gateway(recorder.url(HOST), resolver=resolver) as gateway:
        started = time.monotonic()
        outcome = submit(gateway, in_seconds(0.5))
        took = time.monotonic() - started
        resolver.release()  # the answer comes, late
        assert resolver.answered.wait(5)
    assert outcome == NotSent("ResolveTimeout", SendPhase.RESOLVE)
    assert took < 0.5 + SLACK
    assert resolver.asked == 1
    assert recorder.accepted == 0 and recorder.all_bytes() == b""


# -- TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A throwaway certificate for ``HOST`` (its key and certificate files)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={HOST}",
            "-addext", f"subjectAltName=DNS:{HOST}", "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


def test_a_tls_handshake_held_past_the_deadline_is_not_sent_and_no_request_byte_arrives(
    certificate: tuple[Path, Path],
) -> None:
    key, cert = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    client_side = ssl.create_default_context(cafile=str(cert))
    # The name takes 1.0 s of the 1.5 s, so the handshake starts late: timed from the connect's
    # start (1.5 s, what was left then) it would run until 2.5 s. The terminator completes it
    # half a second after the bound.
    server = Recorder(tls=server_side)
    try:
        resolver = SlowResolver(delay=1.0)
        with http_gateway(server.url(HOST, "https"), resolver=resolver, verify=client_side) as gw:
            deadline = Deadline(in_seconds(1.5), time.monotonic() + 1.5)
            server.hold_until = deadline.expires + 0.5
            outcome = submit(gw, deadline)
        finished = time.monotonic()
        wait_until(lambda: server.finished() == 1, timeout=10, what="the terminator's connection")
    finally:
        server.stop()
    assert outcome == NotSent("ConnectTimeout", SendPhase.TLS)
    assert finished < deadline.expires + SLACK
    assert server.all_bytes() == b""  # no request byte ever reached the terminator


def test_a_tls_downstream_inside_the_deadline_is_answered_as_usual(
    certificate: tuple[Path, Path],
) -> None:
    """The control: the same terminator, holding nothing, gets the whole request. It would
    speak HTTP/2 if offered: the transport offers HTTP/1.1 only (its first-byte check is per
    request, on a connection carrying one request at a time)."""
    key, cert = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    server_side.set_alpn_protocols(["h2", "http/1.1"])
    server = Recorder(tls=server_side)
    try:
        resolver = SlowResolver(delay=0.0)
        client_side = ssl.create_default_context(cafile=str(cert))
        with http_gateway(server.url(HOST, "https"), resolver=resolver, verify=client_side) as gw:
            outcome = submit(gw, in_seconds(0.8))  # the terminator never answers
        wait_until(lambda: server.finished() == 1, timeout=10, what="the terminator's connection")
    finally:
        server.stop()
    assert isinstance(outcome, Unknown)  # the request left: maybe sent
    assert server.all_bytes().startswith(b"POST /v1/refunds")


def test_a_certificate_the_system_does_not_trust_is_refused_by_default(
    certificate: tuple[Path, Path],
) -> None:
    key, cert = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    server = Recorder(tls=server_side)
    try:
        resolver = SlowResolver(delay=0.0)
        with http_gateway(server.url(HOST, "https"), resolver=resolver) as gw:  # verify: default
            outcome = submit(gw, in_seconds(5.0))
        wait_until(lambda: server.finished() == 1, timeout=10, what="the terminator's connection")
    finally:
        server.stop()
    assert outcome == NotSent("ConnectError", SendPhase.TLS)
    assert server.all_bytes() == b""


# -- the first byte ----------------------------------------------------------------------


class Stall:
    """A sender stalled right before its first byte for longer than its bound: its own clock
    jumps (a GC pause, a queue) when armed."""

    def __init__(self, clock: FakeMonotonic, seconds: float) -> None:
        self.clock = clock
        self.seconds = seconds
        self.armed = True
        self.stalled = 0

    def __call__(self) -> None:
        if self.armed:
            self.clock.advance(self.seconds)
            self.stalled += 1


def fake_deadline(clock: FakeMonotonic, seconds: float) -> Deadline:
    return Deadline(in_seconds(seconds), clock() + seconds, clock)


def test_a_sender_stalled_before_its_first_byte_past_the_bound_writes_nothing(
    recorder: Recorder,
) -> None:
    clock = FakeMonotonic()
    stall = Stall(clock, seconds=10.0)
    with http_gateway(recorder.url(), before_first_byte=stall) as gateway:
        outcome = submit(gateway, fake_deadline(clock, 5.0))
    assert outcome == NotSent("deadline passed before the first byte", SendPhase.WRITE)
    assert stall.stalled == 1
    wait_until(lambda: recorder.finished() == 1, timeout=5, what="the connection to close")
    assert recorder.accepted == 1 and recorder.all_bytes() == b""


def test_a_pooled_connection_reused_after_a_stall_writes_nothing(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    sim_control.create_order("acme", "A1", 10000, "CNY")
    clock = FakeMonotonic()
    stall = Stall(clock, seconds=10.0)
    stall.armed = False
    resolver = SlowResolver(delay=0.0)  # counts the connections made: one question each
    url = f"http://{HOST}:{simulator.port}"
    keys = {sim_tenant.name: sim_tenant.api_key}
    transport = BoundedTransport(resolver=resolver, before_first_byte=stall)
    with HttpGateway(url, keys, timeout=10.0, transport=transport) as gateway:
        assert isinstance(submit(gateway, fake_deadline(clock, 5.0), key="k1"), Accepted)
        stall.armed = True
        outcome = submit(gateway, fake_deadline(clock, 5.0), key="k2")
    assert outcome == NotSent("deadline passed before the first byte", SendPhase.WRITE)
    assert resolver.asked == 1  # the second request was for the kept-alive connection
    assert sim_control.requests("acme", "k1") == 1
    assert sim_control.requests("acme", "k2") == 0 and sim_control.effects("acme", "k2") == 0


#: A sender in a process of its own that stops itself (SIGSTOP) right before its first byte.
STOPPED_SENDER = """
import json, os, signal, sys, time
from datetime import UTC, datetime, timedelta
from pydantic import SecretStr
from outbox.clock import Deadline
from outbox.kinds import default_registry
from workers.http_client import HttpGateway
from workers.transport import BoundedBackend, BoundedTransport, bound_request

url, seconds = sys.argv[1], float(sys.argv[2])
deadline = Deadline(datetime.now(UTC) + timedelta(seconds=seconds), time.monotonic() + seconds)

def stop():
    print(json.dumps({"expires": deadline.expires}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)

transport = BoundedTransport(before_first_byte=stop)
with HttpGateway(url, {"acme": SecretStr("sk")}, transport=transport) as gateway:
    outcome = gateway.submit(
        tenant="acme", op_id="op-1", kind=default_registry().get("refund"),
        idempotency_key="k1", deadline=deadline,
        params={"order_id": "A1", "amount_minor": 2500, "currency": "CNY", "payee": "P1"},
    )
print(json.dumps({"outcome": type(outcome).__name__, "phase": getattr(outcome, "phase", None)}))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_process_stopped_before_its_first_byte_and_resumed_after_its_deadline_writes_nothing(
    recorder: Recorder,
) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", STOPPED_SENDER, recorder.url(), "1.0"],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline()  # printed right before it stops itself
            expires = json.loads(line)["expires"]
            _, status = os.waitpid(child.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status)
            # CLOCK_MONOTONIC is the machine's: resume the child once its deadline has passed.
            wait_until(lambda: time.monotonic() > expires + 0.2, timeout=5, what="the deadline")
            os.kill(child.pid, signal.SIGCONT)
            out, _ = child.communicate(timeout=20)
        except BaseException:
            child.kill()  # a stopped child dies of SIGKILL too
            raise
    assert child.returncode == 0
    assert json.loads(out.strip().splitlines()[-1]) == {"outcome": "NotSent", "phase": "write"}
    wait_until(lambda: recorder.finished() == 1, timeout=5, what="the connection to close")
    assert recorder.accepted == 1 and recorder.all_bytes() == b""


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux only")
def test_the_kernel_is_told_to_stop_retransmitting_at_each_requests_bound(
    recorder: Recorder,
) -> None:
    def kernel_timeout_ms(stream: httpcore.NetworkStream) -> int:
        sock = stream.get_extra_info("socket")
        return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))

    backend = BoundedBackend()
    with bound_request(Deadline(in_seconds(3.0), time.monotonic() + 3.0)):
        stream = backend.connect_tcp("127.0.0.1", recorder.port, timeout=10.0)
    try:
        assert 0 < kernel_timeout_ms(stream) <= 3000
        with bound_request(Deadline(in_seconds(0.5), time.monotonic() + 0.5)):
            stream.write(b"x")  # the next request on the kept-alive connection: its own bound
        assert 0 < kernel_timeout_ms(stream) <= 500
    finally:
        stream.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux only")
def test_a_connection_outside_any_bound_keeps_the_kernels_own_timeout(
    recorder: Recorder,
) -> None:
    """No bound and no timeout (httpcore's None): nothing to tell the kernel, and no error."""
    stream = BoundedBackend().connect_tcp("127.0.0.1", recorder.port)
    try:
        sock = stream.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
    finally:
        stream.close()


# -- no retries ----------------------------------------------------------------------------


def test_a_refused_connection_is_tried_once() -> None:
    """The transport never tries again on its own: whether and when an operation is sent again
    is the executor's to decide, on what it recorded (a retry inside the transport would be a
    send it never hears of)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: every connect is refused
    try:
        resolver = SlowResolver(delay=0.0)
        url = f"http://{HOST}:{closed.getsockname()[1]}"
        with http_gateway(url, resolver=resolver) as gateway:
            outcome = submit(gateway, in_seconds(5.0))
    finally:
        closed.close()
    assert outcome == NotSent("ConnectError", SendPhase.CONNECT)
    assert resolver.asked == 1  # each connect asks for the name: one connect


# -- a trickling answer ------------------------------------------------------------------


@pytest.fixture
def stripe_order(sim_control: SimulatorControl, sim_tenant: SimTenant) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10000, "CNY")


def test_a_stripe_answer_trickling_a_byte_at_a_time_ends_at_the_deadline_as_unknown(
    stripe_order: None,
    sim_proxy: FaultProxy,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
) -> None:
    # The refund's answer one byte every 0.5 s (the simulator's ``slow_body``, on the create
    # alone: the payment intent read before it answers at once): a per-read timeout (1.5 s)
    # would wait for every byte; the bound ends the attempt at 1.5 s.
    sim_control.add_rule("slow_body", "k1", times=1, hold_seconds=0.5)
    api_base = sim_proxy.url + STRIPE_PREFIX
    keys = {sim_tenant.name: sim_tenant.api_key}
    gateway = StripeGateway(keys, api_base=api_base, timeout=10.0)
    try:
        deadline = Deadline(in_seconds(1.5), time.monotonic() + 1.5)
        outcome = submit(gateway, deadline)
        ended = time.monotonic()
        assert isinstance(outcome, Unknown)  # the request left: maybe made
        assert ended < deadline.expires + SLACK
        assert sim_control.effects("acme", "k1") == 1  # it was: unknown, never "not sent"
        # One byte every 0.5 s, and the connection reset after 20 of them.
        sim_proxy.trickle(0.5, cut_after_bytes=20)
        lookup_deadline = Deadline(in_seconds(1.5), time.monotonic() + 1.5)
        found = gateway.lookup(
            DownstreamRequest("acme", "op-1", REFUND, "k1", PARAMS), deadline=lookup_deadline
        )
        assert isinstance(found, Unavailable)
        assert time.monotonic() < lookup_deadline.expires + SLACK
    finally:
        gateway.close()


def test_a_payment_intent_read_trickling_ends_at_the_deadline_with_no_refund_asked_for(
    stripe_order: None,
    sim_proxy: FaultProxy,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
) -> None:
    sim_proxy.trickle(0.5, cut_after_bytes=20)  # every answer, the intent read's first
    keys = {sim_tenant.name: sim_tenant.api_key}
    gateway = StripeGateway(keys, api_base=sim_proxy.url + STRIPE_PREFIX, timeout=10.0)
    try:
        deadline = Deadline(in_seconds(1.5), time.monotonic() + 1.5)
        outcome = submit(gateway, deadline)
        assert isinstance(outcome, NotSent), outcome  # the create was never sent
        assert time.monotonic() < deadline.expires + SLACK
        assert sim_control.requests("acme", "k1") == 0
        assert sim_control.effects("acme", "k1") == 0
    finally:
        gateway.close()


def test_a_wire_protocol_answer_trickling_a_byte_at_a_time_ends_at_the_deadline(
    sim_proxy: FaultProxy,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    stripe_order: None,
) -> None:
    sim_proxy.trickle(0.5, cut_after_bytes=20)
    keys = {sim_tenant.name: sim_tenant.api_key}
    with HttpGateway(sim_proxy.url, keys, timeout=10.0) as gateway:
        deadline = Deadline(in_seconds(1.5), time.monotonic() + 1.5)
        outcome = submit(gateway, deadline)
        assert time.monotonic() < deadline.expires + SLACK
    assert isinstance(outcome, Unknown)
    assert sim_control.effects("acme", "k1") == 1


# -- through the executor ----------------------------------------------------------------


def test_a_slow_resolver_under_a_3s_lease_leaves_the_attempt_not_sent_and_zero_effects(
    rig: Rig,
) -> None:
    op = rig.enqueue("op-1", GOOD)
    resolver = SlowResolver(delay=4.0)  # answers a second after the lease ends
    executor = rig.executor(lease_seconds=3.0)
    gateway = http_gateway(
        f"http://{HOST}:{rig.url.rsplit(':', 1)[1]}",
        {rig.tenant.name: rig.tenant.api_key},
        resolver=resolver,
    )
    rig.gateways.append(gateway)  # closed at teardown
    executor.gateway = gateway
    try:
        written = executor.execute([op])
    finally:
        resolver.release()  # the answer comes, after the lease
    assert resolver.answered.wait(10)
    assert written == {op: State.PLANNED}
    (attempt,) = rig.attempts(op)
    assert attempt.proof == "not_sent"
    assert attempt.detail is not None and attempt.detail["phase"] == "resolve"
    assert rig.effects(op) == 0 and rig.sends(op) == 0
