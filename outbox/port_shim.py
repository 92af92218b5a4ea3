"""The port's calls as earlier releases made them, for one release more.

An adapter still written with the six keywords of earlier releases (``submit(*, tenant,
op_id, kind, idempotency_key, params, deadline)``) is called the old way: ``as_gateway`` tells
it by its signature, once, and wraps it (``OldStyleGateway``) with a ``DeprecationWarning``;
the services call it where they are built. The shipped gateways accept the old keywords from a
caller for the same release (``old_keywords``), with a warning too. Pure, like the port.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar, cast

from outbox.clock import Deadline
from outbox.downstream import DownstreamRequest, Gateway, LookupOutcome, SubmitOutcome

#: The keywords a gateway's calls took before ``DownstreamRequest`` (with ``deadline``).
OLD_KEYWORDS = ("tenant", "op_id", "kind", "idempotency_key", "params")

_NEW_FORM = (
    "write submit(self, request: DownstreamRequest, *, deadline) and "
    "lookup(self, request: DownstreamRequest, *, deadline) (outbox.downstream)"
)


def takes_request(call: Callable[..., Any]) -> bool:
    """Whether a gateway's ``submit`` or ``lookup`` takes the request value (it can be called
    as ``call(request, deadline=...)``); False for one written with the old keywords only."""
    try:
        signature = inspect.signature(call)
    except (TypeError, ValueError):  # not introspectable (a builtin): take it at its word
        return True
    try:
        signature.bind(None, deadline=None)
    except TypeError:
        return False
    return True


class OldStyleGateway:
    """A gateway whose ``submit`` or ``lookup`` takes the old keywords (``tenant=``,
    ``op_id=``, ``kind=``, ``idempotency_key=``, ``params=``, ``deadline=``), called that way
    behind the new port; made by ``as_gateway``. Its ``params`` is a fresh ``dict``, as
    before. Anything else is the wrapped gateway's (``close``, a fake's records)."""

    def __init__(self, inner: Any, *, old: frozenset[str]) -> None:
        self.inner = inner
        #: which of "submit" and "lookup" take the old keywords
        self.old = old

    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        if "submit" in self.old:
            return cast(SubmitOutcome, self.inner.submit(**_old_form(request), deadline=deadline))
        return cast(SubmitOutcome, self.inner.submit(request, deadline=deadline))

    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        if "lookup" in self.old:
            return cast(LookupOutcome, self.inner.lookup(**_old_form(request), deadline=deadline))
        return cast(LookupOutcome, self.inner.lookup(request, deadline=deadline))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): not the inner's either
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"OldStyleGateway({self.inner!r})"


def _old_form(request: DownstreamRequest) -> dict[str, Any]:
    return {
        "tenant": request.tenant,
        "op_id": request.op_id,
        "kind": request.kind,
        "idempotency_key": request.idempotency_key,
        "params": dict(request.params),
    }


def as_gateway(gateway: Any, *, stacklevel: int = 1) -> Gateway:
    """``gateway`` as the port takes it: itself, or, where its ``submit`` or ``lookup`` is
    written with the old keywords, wrapped to be called that way (``OldStyleGateway``), with
    a ``DeprecationWarning`` that names the new form (``stacklevel`` counts from the caller).
    Told once, by signature; the services call it where they are built. The old form is
    called for one release more."""
    if isinstance(gateway, OldStyleGateway):
        return gateway
    # A method it lacks is no sign of either form: calling it fails as it always did.
    methods = {name: getattr(gateway, name, None) for name in ("submit", "lookup")}
    old = frozenset(name for name, call in methods.items() if call and not takes_request(call))
    if not old:
        return cast(Gateway, gateway)
    name = type(gateway).__qualname__
    calls = " and ".join(f"{name}.{call}" for call in sorted(old))
    verb = "takes" if len(old) == 1 else "take"
    warnings.warn(
        f"{calls} {verb} the old keywords (tenant=, op_id=, kind=, idempotency_key=, "
        f"params=, deadline=), called that way for one release more: {_NEW_FORM}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return OldStyleGateway(gateway, old=old)


_Call = TypeVar("_Call", bound=Callable[..., Any])


def old_keywords(method: _Call) -> _Call:
    """A gateway's ``submit`` or ``lookup`` that a caller may still call with the old
    keywords for one release: the request is made of them, with a ``DeprecationWarning``.
    A call with the request passes straight through."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args or not set(OLD_KEYWORDS) <= kwargs.keys():
            return method(self, *args, **kwargs)
        warnings.warn(
            f"{type(self).__qualname__}.{method.__name__}(tenant=, op_id=, kind=, "
            f"idempotency_key=, params=, deadline=) is deprecated: call "
            f"{method.__name__}(DownstreamRequest(tenant, op_id, kind, idempotency_key, params), "
            "deadline=...) (outbox.downstream)",
            DeprecationWarning,
            stacklevel=2,
        )
        request = DownstreamRequest(*(kwargs.pop(name) for name in OLD_KEYWORDS))
        return method(self, request, **kwargs)

    return cast(_Call, call)
