"""The simulator's HTTP layer on its own, serving a scripted application: what it hands the
application, keep-alive, and what the application may do to the connection (reset, watch)."""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from settled.simulator.httpserver import HttpServer
from settled.simulator.messages import Connection, Request, Response
from tests.support.simtools import wait_until

Script = Callable[[Request, Connection], Response]


class ScriptedApp:
    """Answers each request with what ``script`` returns; remembers the requests."""

    def __init__(self) -> None:
        self.script: Script = lambda request, connection: Response(200, {"ok": True}, {})
        self.seen: list[Request] = []

    def respond(self, request: Request, connection: Connection) -> Response:
        self.seen.append(request)
        return self.script(request, connection)

    def route_of(self, path: str) -> str:
        return path


@pytest.fixture
def app() -> ScriptedApp:
    return ScriptedApp()


@pytest.fixture
def stopping() -> threading.Event:
    return threading.Event()


@pytest.fixture
def server(app: ScriptedApp, stopping: threading.Event) -> Iterator[HttpServer]:
    server = HttpServer(("127.0.0.1", 0), app, stopping=stopping, idle_timeout=30)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        stopping.set()
        server.shutdown()
        server.server_close()
        thread.join()


def connect(server: HttpServer) -> http.client.HTTPConnection:
    host, port = server.server_address[:2]
    return http.client.HTTPConnection(str(host), int(port), timeout=5)


def test_the_application_gets_method_path_fields_and_body_and_one_connection_carries_both(
    server: HttpServer, app: ScriptedApp
) -> None:
    conn = connect(server)
    try:
        conn.request("POST", "/v1/x?ignored=1", body=b'{"a": 1}', headers={"X-Thing": "One"})
        first = conn.getresponse()
        assert (first.status, json.loads(first.read())) == (200, {"ok": True})
        assert first.getheader("Content-Type") == "application/json"
        assert not first.will_close
        sock = conn.sock
        conn.request("DELETE", "/v1/y")
        second = conn.getresponse()
        second.read()
        assert second.status == 200
        assert conn.sock is sock  # kept alive: the same socket carried both
    finally:
        conn.close()
    one, two = app.seen
    assert (one.method, one.path, one.body) == ("POST", "/v1/x", b'{"a": 1}')
    assert one.fields["x-thing"] == "One"  # by lower-case name
    assert (two.method, two.path, two.body) == ("DELETE", "/v1/y", b"")


def test_an_application_reset_drops_only_its_request_and_the_server_serves_on(
    server: HttpServer, app: ScriptedApp
) -> None:
    def reset_on_drop(request: Request, connection: Connection) -> Response:
        if request.path == "/drop":
            connection.reset()
        return Response(201, {"path": request.path}, {"X-Extra": "yes"})

    app.script = reset_on_drop
    other = connect(server)
    dropped = connect(server)
    try:
        other.request("GET", "/before")
        assert other.getresponse().read() == b'{"path": "/before"}'
        dropped.request("GET", "/drop")
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            dropped.getresponse()
        other.request("GET", "/after")
        answer = other.getresponse()
        assert (answer.status, answer.getheader("X-Extra")) == (201, "yes")
        assert json.loads(answer.read()) == {"path": "/after"}
    finally:
        other.close()
        dropped.close()
    wait_until(lambda: server.open_connections() == 0, what="both connections to close")


def test_the_application_sees_the_client_hang_up(server: HttpServer, app: ScriptedApp) -> None:
    watching = threading.Event()
    seen: queue.Queue[bool] = queue.Queue()

    def watch(request: Request, connection: Connection) -> Response:
        watching.set()
        end = time.monotonic() + 5  # polled, as a hold polls; bounded so it cannot hang
        while not (closed := connection.peer_closed()) and time.monotonic() < end:
            time.sleep(0.01)
        seen.put(closed)
        return Response(200, {}, {})

    app.script = watch
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), int(port)), timeout=5) as sock:
        sock.sendall(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n")
        assert watching.wait(5)
    assert seen.get(timeout=10) is True


def test_once_stopping_every_answer_closes_its_connection(
    server: HttpServer, stopping: threading.Event
) -> None:
    conn = connect(server)
    try:
        conn.request("GET", "/one")
        first = conn.getresponse()
        first.read()
        assert first.getheader("Connection") is None
        stopping.set()
        conn.request("GET", "/two")
        second = conn.getresponse()
        second.read()
        assert second.getheader("Connection") == "close"
    finally:
        conn.close()
