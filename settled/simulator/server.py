"""Running the simulator: in a background thread (tests, the demo) or until interrupted.

The parts, one at a time:

- ``httpserver``: HTTP/1.1 keep-alive connections, request heads and bodies, answers;
- ``app``: routes a request to a submit, a lookup or the control API;
- ``submit`` / ``lookup``: the downstream API (docs/wire-protocol.md);
- ``injection``: what each fault does, phase by phase; ``faults``: which fault a request draws;
- ``control_api``: the control API's route table (test mode);
- ``state``: switches, clock, counters and holds; ``ledger``: the durable ledger.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from outbox import logs
from settled.simulator.app import Application
from settled.simulator.httpserver import IDLE_TIMEOUT_SECONDS, HttpServer
from settled.simulator.ledger import Ledger, engine_for
from settled.simulator.state import Simulator, Switches

__all__ = ["IDLE_TIMEOUT_SECONDS", "SimulatorHandle", "Switches", "run", "start_in_thread"]

log = logging.getLogger(__name__)


class SimulatorHandle:
    """A simulator serving in a background thread (tests, the demo)."""

    def __init__(self, server: HttpServer, sim: Simulator, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.sim = sim
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
    deadline_fence: bool = True,
    provider_keys: bool = False,
) -> tuple[HttpServer, Simulator, dict[str, str]]:
    book = Ledger(engine_for(ledger))
    for tenant, api_key in (tenants or {}).items():
        book.add_tenant(tenant, api_key)
    try:
        sim = Simulator(book, test_mode=test_mode, switches=Switches(deadline_fence=deadline_fence))
        app = Application(sim)
        keys = app.make_provider_keys() if provider_keys else {}
        server = HttpServer(
            (host, port), app, stopping=sim.stopping, idle_timeout=idle_timeout, clock=sim.now
        )
    except BaseException:
        book.close()
        raise
    return server, sim, keys


def start_in_thread(
    host: str = "127.0.0.1",
    port: int = 0,
    ledger: str = ":memory:",
    test_mode: bool = True,
    tenants: Mapping[str, str] | None = None,
    idle_timeout: float = IDLE_TIMEOUT_SECONDS,
    deadline_fence: bool = True,
    provider_keys: bool = False,
) -> SimulatorHandle:
    """Serve in a daemon thread; ``port=0`` picks a free port (see ``handle.port``).

    ``idle_timeout``: how long a keep-alive connection may stay idle (see
    ``IDLE_TIMEOUT_SECONDS``; tests shorten it to see clients cope with a closed connection).
    ``deadline_fence``: the switch of that name it starts (and resets) with.
    ``provider_keys``: make the WeChat Pay and Alipay modes' keys now (else at first use: a
    test's simulator that never speaks those modes makes none).
    """
    server, sim, _ = _serve(
        host, port, ledger, test_mode, tenants, idle_timeout, deadline_fence, provider_keys
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="simulator", daemon=True
    )
    thread.start()
    return SimulatorHandle(server, sim, thread)


def run(
    host: str,
    port: int,
    ledger: str,
    test_mode: bool,
    tenants: Mapping[str, str] | None = None,
    deadline_fence: bool = True,
) -> None:
    """Serve until interrupted (the ``settled simulator`` command); logs as ``outbox.logs``
    says (``SETTLED_LOG_LEVEL``, ``SETTLED_LOG_FORMAT``). The WeChat Pay and Alipay modes'
    keys are made before it listens, and the line that says so names them (the public keys
    themselves: the control API, ``/_control/alipay_keys`` and a merchant's registration)."""
    logs.configure()
    server, sim, keys = _serve(
        host, port, ledger, test_mode, tenants, deadline_fence=deadline_fence, provider_keys=True
    )
    log.info(
        "simulator listening",
        extra={
            "host": host,
            "port": server.server_address[1],
            "test_mode": test_mode,
            "deadline_fence": deadline_fence,
            **keys,
        },
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        sim.stopping.set()
        server.server_close()
        sim.ledger.close()
