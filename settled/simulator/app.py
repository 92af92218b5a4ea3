"""The simulator as the HTTP layer sees it: a request in, an answer out.

Routes: ``/_control/...`` to the control API (test mode only; else 404), ``POST`` on a kind's
endpoint to a submit, ``GET /v1/lookup/{key}`` to a lookup, ``/stripe/...`` to the Stripe mode
(``stripe``), ``/wechatpay/...`` to the WeChat Pay mode (``wechatpay``, its control routes under
``/_control/wechatpay/``), ``/alipay/...`` to the Alipay mode (``alipay``); anything else
answers 404.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from urllib.parse import unquote

from outbox import wire
from outbox.kinds import Kind, default_registry
from settled.simulator import alipay, control_api, stripe, wechatpay, wechatpay_control
from settled.simulator.lookup import list_effects, lookup
from settled.simulator.messages import NO_SUCH_ROUTE, Answer, Connection, Request, Response
from settled.simulator.state import Simulator
from settled.simulator.submit import submit

CONTROL_PREFIX = "/_control/"
LOOKUP_PREFIX = wire.LOOKUP_PATH.format(key="")


def _as_provider(response: Response) -> Response:
    """A provider mode's answer: its time said by ``Date`` alone (whole seconds), as the
    provider says it, never the wire protocol's ``Settled-Server-Time``."""
    return replace(response, server_time=False)


class Application:
    """Routes each request to its handler and answers for it."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        registry = default_registry()
        #: endpoint -> the kind submitted there
        self.kinds: dict[str, Kind] = {
            kind.endpoint: kind for kind in map(registry.get, registry.names())
        }
        self._wechatpay: wechatpay.WechatPayMode | None = None
        self._wechatpay_lock = threading.Lock()

    def make_provider_keys(self) -> dict[str, str]:
        """Make the provider modes' keys now (WeChat Pay's platform key, Alipay's key pair),
        not at their first use; what names them (public), for the start's log line."""
        return {
            "wechatpay_platform_serial": self.wechatpay.platform_serial,
            "alipay_public_key_sha256": self.sim.alipay.fingerprint(),
        }

    @property
    def wechatpay(self) -> wechatpay.WechatPayMode:
        """The WeChat Pay mode's state, its platform key made at start (``make_provider_keys``)
        or when it is first used."""
        with self._wechatpay_lock:
            if self._wechatpay is None:
                self._wechatpay = wechatpay.WechatPayMode()
            return self._wechatpay

    def respond(self, request: Request, connection: Connection) -> Response:
        """The answer to ``request`` (or a reset of ``connection``, by a fault)."""
        sim, method, path = self.sim, request.method, request.path
        try:
            if path.startswith(CONTROL_PREFIX):
                if not sim.test_mode:
                    return NO_SUCH_ROUTE
                route = path[len(CONTROL_PREFIX) :]
                if route.startswith(wechatpay_control.PREFIX):
                    rest = route[len(wechatpay_control.PREFIX) :]
                    return wechatpay_control.control(
                        self.wechatpay, sim, method, rest, request.body
                    )
                return control_api.respond(sim, method, route, request.body)
            if path.startswith(stripe.PREFIX + "/"):
                return _as_provider(stripe.respond(sim, request, connection))
            if path.startswith(wechatpay.PREFIX + "/"):
                return _as_provider(wechatpay.respond(self.wechatpay, sim, request, connection))
            if path.startswith(alipay.PREFIX + "/"):
                return _as_provider(alipay.respond(sim, request, connection))
            if method == "POST" and path in self.kinds:
                return submit(sim, self.kinds[path], request, connection)
            if method == "GET" and path == wire.EFFECTS_PATH:
                return list_effects(sim, request)
            if method == "GET" and path.startswith(LOOKUP_PREFIX):
                return lookup(sim, unquote(path[len(LOOKUP_PREFIX) :]), request, connection)
            return NO_SUCH_ROUTE
        except Answer as answer:
            return answer.response

    def route_of(self, path: str) -> str:
        """``path`` as the request log shows it: the lookup's route, not the key in it; the
        Stripe mode's route, not the payment intent or refund named in it; WeChat Pay's query
        route, not the refund number in it."""
        if path.startswith(stripe.PREFIX + "/"):
            return stripe.route_of(path)
        if path.startswith(wechatpay.REFUNDS + "/"):
            return wechatpay.REFUNDS + "/{out_refund_no}"
        return wire.LOOKUP_PATH if path.startswith(LOOKUP_PREFIX) else path
