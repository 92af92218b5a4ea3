"""A TCP fault proxy to put in front of the simulator (or any downstream) in tests.

Modes: ``pass`` forwards bytes both ways; ``refuse`` closes the listening socket and the open
connections, so a client must connect anew and is refused (nothing is sent), and
``refuse_for`` does so for a window (an outage: a restart of the service, a deploy), then
listens again; ``delay`` holds the
response for some seconds (the request has reached the downstream); ``cut`` forwards the first
bytes of the response, then resets the client; ``trickle`` forwards the response one byte at a
time, a pause before each (a slow network, or a downstream answering byte by byte);
``hold_request`` holds the request's bytes until ``release`` (or some seconds), then delivers
them even if the client has given up and gone, as a proxy's queue or a slow path would: the
request lands late. ``delay`` and ``cut`` can be aimed at some requests only (``only``: the
bytes a request starts with, e.g. ``b"POST "``), the others forwarded faithfully.

Clients keep connections alive, so a mode applies to every response (``hold_request``: every
request) that starts after it is set, on open connections as on new ones. (The proxy does not
parse HTTP: a response starts with the first bytes from upstream after bytes from the client,
and a request with the first bytes from the client after a response, which holds for clients
that do not pipeline.)
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Literal

Mode = Literal["pass", "delay", "cut", "trickle", "hold_request"]


@dataclass(frozen=True)
class _Setting:
    mode: Mode = "pass"
    delay_seconds: float = 0.0
    cut_after_bytes: int = 0
    trickle_seconds: float = 0.0
    #: ``hold_request``: set by ``release`` (or ``stop``) to end the holds
    released: threading.Event | None = None
    #: the mode applies only to requests whose first bytes start so (``b"POST "``); the
    #: others are forwarded faithfully
    only: bytes | None = None

    def applies_to(self, request_head: bytes) -> _Setting:
        """This setting for a request that starts with ``request_head``: itself, or
        faithful forwarding if it is aimed at other requests."""
        if self.only is None or request_head.startswith(self.only):
            return self
        return _Setting()


class FaultProxy:
    """Forward ``127.0.0.1:port`` to ``upstream``, misbehaving on request."""

    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1") -> None:
        self._upstream = (upstream_host, upstream_port)
        self._host = host
        self._setting = _Setting()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._clients: set[socket.socket] = set()
        #: bumped by every change of mode: a timed outage ends only the mode it set
        self._generation = 0
        self._outage: threading.Timer | None = None
        #: responses that came back from upstream (to a client still there or not)
        self.answered = 0
        self._listener: socket.socket | None = self._listen(0)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._acceptor.start()

    # -- modes --------------------------------------------------------------------------

    def passthrough(self) -> None:
        """Forward faithfully (and listen again after ``refuse``)."""
        self._set(_Setting())

    def delay(self, seconds: float, *, only: bytes | None = None) -> None:
        """Hold every response ``seconds`` before forwarding it (with ``only``: the responses
        to requests that start with those bytes, e.g. ``b"POST "``)."""
        self._set(_Setting("delay", delay_seconds=seconds, only=only))

    def cut(self, after_bytes: int = 12, *, only: bytes | None = None) -> None:
        """Forward ``after_bytes`` of the response, then reset the client connection (with
        ``only``: of the responses to requests that start with those bytes)."""
        self._set(_Setting("cut", cut_after_bytes=after_bytes, only=only))

    def trickle(self, every_seconds: float, cut_after_bytes: int = 0) -> None:
        """Forward every response one byte each ``every_seconds``; with ``cut_after_bytes``,
        reset the client after that many bytes."""
        self._set(
            _Setting("trickle", trickle_seconds=every_seconds, cut_after_bytes=cut_after_bytes)
        )

    def hold_requests(self, seconds: float = 30.0) -> None:
        """Hold every request that starts from now on until ``release`` (at most ``seconds``),
        then deliver it, whether its client still waits or not."""
        self._set(_Setting("hold_request", delay_seconds=seconds, released=threading.Event()))

    def release(self) -> None:
        """Deliver the held requests now, and forward faithfully from now on."""
        with self._lock:
            released = self._setting.released
        self.passthrough()
        if released is not None:
            released.set()

    def refuse(self) -> None:
        """Stop listening and close the open connections: connects are refused until another
        mode is set."""
        with self._lock:
            self._generation += 1
            listener, self._listener = self._listener, None
            clients = list(self._clients)
        if listener is not None:
            _close_listener(listener)
        for client in clients:  # its forwarding thread then reads EOF and closes it
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)

    def refuse_for(self, seconds: float) -> None:
        """An outage: refuse connections now (as ``refuse``), and listen and forward again
        ``seconds`` later, unless another mode was set meanwhile (``refusing`` says which)."""
        self.refuse()
        with self._lock:
            generation = self._generation

        def end() -> None:
            with self._lock:
                if self._generation == generation and not self._stopping.is_set():
                    self._set_locked(_Setting())

        timer = threading.Timer(seconds, end)
        timer.daemon = True
        with self._lock:
            self._outage = timer
        timer.start()

    @property
    def refusing(self) -> bool:
        """Whether connections are refused now (``refuse``, or an outage not over yet)."""
        with self._lock:
            return self._listener is None and not self._stopping.is_set()

    def _set(self, setting: _Setting) -> None:
        with self._lock:
            self._set_locked(setting)

    def _set_locked(self, setting: _Setting) -> None:
        self._generation += 1
        self._setting = setting
        if self._listener is None:
            self._listener = self._listen(self.port)

    # -- lifecycle ----------------------------------------------------------------------

    def stop(self) -> None:
        """Close the listener and every connection; join every thread."""
        self._stopping.set()
        self._acceptor.join()
        with self._lock:
            listener, self._listener = self._listener, None
            threads = list(self._threads)
            released = self._setting.released
            outage = self._outage
        if outage is not None:
            outage.cancel()
            if outage is not threading.current_thread():
                outage.join()
        if released is not None:
            released.set()
        if listener is not None:
            _close_listener(listener)
        for thread in threads:
            thread.join()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- forwarding ---------------------------------------------------------------------

    def _listen(self, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._host, port))
        listener.listen(16)
        listener.settimeout(0.02)
        return listener

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                listener = self._listener
            if listener is None:
                self._stopping.wait(0.02)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=self._forward, args=(client,), daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
                self._clients.add(client)
            thread.start()

    def _forward(self, client: socket.socket) -> None:
        try:
            with client:
                try:
                    upstream = socket.create_connection(self._upstream, timeout=5)
                except OSError:
                    _reset(client)
                    return
                with upstream:
                    self._pump(client, upstream)
        finally:
            with self._lock:
                self._clients.discard(client)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        setting = _Setting()
        forwarded = 0
        request_sent = False
        request_head = b""  # the first bytes of the request now forwarded
        late = False  # a held request was delivered: wait for its answer, client gone or not
        while not self._stopping.is_set():
            watched = [upstream] if late else [client, upstream]
            readable, _, _ = select.select(watched, [], [], 0.02)
            try:
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    if not request_sent:  # a request starts: hold it, if that is the mode
                        request_head = data[:64]
                        with self._lock:
                            held = self._setting
                        if held.mode == "hold_request" and held.released is not None:
                            held.released.wait(held.delay_seconds)
                            if self._stopping.is_set():
                                return
                            data += _rest_of(client)  # whatever else it sent meanwhile
                            late = True
                    upstream.sendall(data)
                    request_sent = True
                if upstream in readable:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    if request_sent:  # a response starts: the mode set now applies to it
                        request_sent = late = False
                        with self._lock:
                            self.answered += 1
                        forwarded = 0
                        with self._lock:
                            setting = self._setting.applies_to(request_head)
                        if setting.mode == "delay" and self._stopping.wait(setting.delay_seconds):
                            return
                    if setting.mode == "cut":
                        client.sendall(data[: max(0, setting.cut_after_bytes - forwarded)])
                        forwarded += len(data)
                        if forwarded >= setting.cut_after_bytes:
                            _reset(client)
                            return
                        continue
                    if setting.mode == "trickle":
                        for byte in data:
                            if self._stopping.wait(setting.trickle_seconds):
                                return
                            client.sendall(bytes([byte]))
                            forwarded += 1
                            if forwarded == setting.cut_after_bytes:
                                _reset(client)
                                return
                        continue
                    client.sendall(data)
            except OSError:
                return


def _rest_of(client: socket.socket) -> bytes:
    """What the client has sent and nobody read yet, without waiting (b"" if it is gone)."""
    chunks = []
    while select.select([client], [], [], 0)[0]:
        try:
            chunk = client.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _reset(sock: socket.socket) -> None:
    """Abort with a TCP RST instead of an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _close_listener(listener: socket.socket) -> None:
    """Stop listening at once: a thread still inside accept() keeps a bare close() listening."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()
