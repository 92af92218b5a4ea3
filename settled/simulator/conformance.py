"""The simulator as the ``Downstream`` of the gateway conformance suite (``outbox.conformance``):
for any adapter that talks to Settled's simulator, over its wire protocol or its Stripe mode.

Each script is a fault rule for the request's key, used once (``SimulatorControl.add_rule``);
``unreachable`` needs the adapter to reach the simulator through a ``FaultProxy``, which then
refuses connections. docs/gateway-conformance.md shows the fixture.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from contextlib import contextmanager

from outbox.downstream import DownstreamRequest
from settled.simulator.control import SimulatorControl
from settled.simulator.faults import Fault
from settled.simulator.proxy import FaultProxy


class SimulatorDownstream:
    """The ``outbox.conformance.Downstream`` of a simulator (``control``, in test mode) that
    the adapter under test reaches through ``proxy``."""

    def __init__(
        self,
        control: SimulatorControl,
        proxy: FaultProxy,
        *,
        business_code: str = "amount_exceeds_refundable",
    ) -> None:
        self.control = control
        self.proxy = proxy
        #: the code a business refusal is scripted with (one both protocols know for refunds)
        self.business_code = business_code

    def _once(self, fault: Fault, request: DownstreamRequest, **rule: str) -> None:
        pattern = glob.escape(request.idempotency_key)
        self.control.add_rule(fault, pattern, tenant=request.tenant, times=1, **rule)  # type: ignore[arg-type]

    def effects(self, request: DownstreamRequest) -> int:
        return self.control.effects(request.tenant, request.idempotency_key)

    def refuse_business(self, request: DownstreamRequest) -> None:
        self._once(Fault.BUSINESS_REJECT, request, code=self.business_code)

    def forbid(self, request: DownstreamRequest) -> None:
        self._once(Fault.FORBIDDEN, request)

    def rate_limit(self, request: DownstreamRequest, retry_after: int) -> None:
        self._once(Fault.RATE_LIMITED, request, retry_after=str(retry_after))

    def mismatch_receipt(self, request: DownstreamRequest) -> None:
        self._once(Fault.MISMATCHED_RECEIPT, request)

    def lose_answer(self, request: DownstreamRequest) -> None:
        self._once(Fault.COMMIT_THEN_RESET, request)

    def lookups_down(self, request: DownstreamRequest) -> None:
        self._once(Fault.LOOKUP_UNAVAILABLE, request)

    @contextmanager
    def unreachable(self) -> Iterator[None]:
        self.proxy.refuse()
        try:
            yield
        finally:
            self.proxy.passthrough()
