"""Authentication: the Bearer API key of a request names its tenant."""

from __future__ import annotations

from outbox import wire
from settled.simulator.messages import Answer, Request, error
from settled.simulator.state import Simulator

_AUTHORIZATION = wire.AUTHORIZATION.lower()
_UNAUTHENTICATED = error(401, wire.AUTHENTICATION_ERROR, "invalid_api_key", "invalid API key")


def authenticate(sim: Simulator, request: Request) -> str:
    """The tenant whose API key the request carries; answers 401 if none."""
    scheme, _, token = (request.fields.get(_AUTHORIZATION) or "").partition(" ")
    tenant = None
    if scheme.lower() == "bearer" and token.strip():
        tenant = sim.ledger.tenant_for(token.strip())
    if tenant is None:
        raise Answer(_UNAUTHENTICATED)
    return tenant
