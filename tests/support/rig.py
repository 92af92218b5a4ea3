"""The executor/reconciler test rig: a real database, the simulator over HTTP, helpers that
read both our rows and the simulator's ledger. A pytest plugin module (``rig`` fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.clock_steps import ClockWatch
from outbox.downstream import DownstreamRequest, Gateway, Receipt
from outbox.errors import StaleLease
from outbox.intake import Outbox
from outbox.kinds import KindRegistry, default_registry
from outbox.models import Attempt, Operation, ReviewItem
from outbox.provider_contracts import PROVIDER_CONTRACTS
from outbox.settings_wechatpay import WechatPayMerchant
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import start_attempts
from outbox.storage.claims import Claimed, claim_for_send
from outbox.storage.connection import Bind
from reconciler.reconcile import Reconciler
from settled.simulator import SimulatorControl, SimulatorHandle
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from settled.simulator.wechatpay import PREFIX as WECHATPAY_PREFIX
from tests.support.alipay import gateway_url, register_app, unregistered_key_app
from tests.support.judge import check_truthful
from tests.support.simtools import SimTenant
from tests.support.wechatpay import private_pem, register, rsa_key
from workers.alipay_gateway import AlipayApp, AlipayGateway
from workers.downstream_time import TimeSeen
from workers.executor import Executor
from workers.http_client import HttpGateway
from workers.stripe_gateway import StripeGateway
from workers.wechatpay_gateway import WechatPayGateway
from workers.wechatpay_signing import merchant_keys

#: Client timeout of the rig's gateways: long enough for a loaded machine; faults that hold a
#: response hold it for longer (HOLD).
RIG_CLIENT_TIMEOUT = 2.0
HOLD = 8.0

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


def start_attempt(storage: Storage, bind: Bind, claimed: Claimed, *, worker: str) -> Claimed:
    """``start_attempts`` for one operation; StaleLease when its fence no longer holds."""
    started = start_attempts(storage, bind, [claimed], worker=worker)
    if not started:
        raise StaleLease(operation_id=claimed.id, lease_version=claimed.lease_version)
    return started[0]


@dataclass
class Rig:
    engine: Engine
    outbox: Outbox
    control: SimulatorControl
    tenant: SimTenant
    url: str
    sessions: sessionmaker[Session]
    #: every gateway handed out, closed at teardown (their pools hold keep-alive sockets)
    gateways: list[HttpGateway | StripeGateway | WechatPayGateway | AlipayGateway] = field(
        default_factory=list
    )
    #: whether the test ends on ``check_truthful`` (off only for tests that write outcomes
    #: into storage by hand, with nothing sent)
    judged_by_ledger: bool = True
    #: the gateways handed out speak Stripe to the simulator's Stripe mode (``stripe_rig``)
    stripe: bool = False
    #: the gateways handed out speak WeChat Pay to the simulator's WeChat Pay mode as this
    #: merchant (``wechatpay_rig``)
    wechatpay: WechatPayMerchant | None = None
    #: the tenant's Alipay app: the gateways handed out speak Alipay to the simulator's
    #: Alipay mode (``alipay_rig``)
    alipay: AlipayApp | None = None

    @property
    def storage(self) -> Storage:
        return storage_for(self.engine)

    def claim(self, op_id: int, worker: str = "w1", lease: float = 60.0) -> Claimed:
        """Claim one operation for sending, as a worker's claim step does."""
        with self.sessions.begin() as s:
            (claimed,) = claim_for_send(s, worker=worker, lease_seconds=lease, ids=[op_id])
        return claimed

    def start_send(self, op_id: int, worker: str = "dead", lease: float = 60.0) -> Claimed:
        """Claim one operation and start its attempt (``submitted``), as a worker does just
        before it sends; then nothing more (a worker that died mid-send)."""
        with self.sessions.begin() as s:
            (claimed,) = claim_for_send(s, worker=worker, lease_seconds=lease, ids=[op_id])
            return start_attempt(self.storage, s, claimed, worker=worker)

    def measured_by(self, watch: ClockWatch, by: str) -> TimeSeen:
        """What a process's gateway tells its clock watch of each answer's time
        (``settled.runtime``), recording episodes as ``by``."""

        def seen(
            downstream: str, said: datetime, resolution: float, before: datetime, after: datetime
        ) -> None:
            watch.downstream_answered(
                downstream,
                said,
                resolution,
                db_before=before,
                db_after=after,
                by=by,
                sessions=self.sessions,
            )

        return seen

    def sent_by_a_dead_worker(self, op_id: int) -> Claimed:
        """``start_send``, then the request carried out downstream: a worker that died after
        its send reached the payment service, before it could write what came back."""
        claimed = self.start_send(op_id)
        self.gateway().submit(
            DownstreamRequest(
                self.tenant.name,
                claimed.op_id,
                default_registry().get("refund"),
                claimed.idempotency_key,
                claimed.params,
            ),
            deadline=datetime.now(UTC) + timedelta(seconds=5),
        )
        return claimed

    def executor(
        self, registry: KindRegistry | None = None, url: str | None = None, **kw: Any
    ) -> Executor:
        """An executor sending to the rig's simulator (or ``url``: a proxy in front of it)."""
        gateway = self.gateway(url)
        kw.setdefault("rand", lambda: 0.0)
        return Executor(
            sessions=self.sessions,
            gateway=gateway,
            registry=registry or self.outbox.registry,
            fingerprinter=self.outbox.fingerprinter,
            worker=kw.pop("worker", "w1"),
            **kw,
        )

    def gateway(
        self,
        url: str | None = None,
        api_keys: Mapping[str, SecretStr] | None = None,
        timeout: float = RIG_CLIENT_TIMEOUT,
        time_seen: TimeSeen | None = None,
    ) -> Gateway:
        """A gateway to the rig's simulator (or ``url``), closed when the test ends: the
        wire protocol's, or in a provider's mode that provider's gateway; the time each answer
        says told to ``time_seen``."""
        keys = {self.tenant.name: self.tenant.api_key} if api_keys is None else api_keys
        gateway: HttpGateway | StripeGateway | WechatPayGateway | AlipayGateway
        if self.wechatpay is not None:
            gateway = self._wechatpay_gateway(url, keys, timeout, time_seen)
        elif self.alipay is not None:
            # another key than the tenant's: an app signing with a key Alipay was not given
            wrong = api_keys is not None and api_keys != {self.tenant.name: self.tenant.api_key}
            app = unregistered_key_app(self.alipay) if wrong else self.alipay
            apps = {self.tenant.name: app}
            url_ = gateway_url(url or self.url)
            gateway = AlipayGateway(apps, gateway_url=url_, timeout=timeout, time_seen=time_seen)
        elif self.stripe:
            base = (url or self.url) + STRIPE_PREFIX
            gateway = StripeGateway(keys, api_base=base, timeout=timeout, time_seen=time_seen)
        else:
            gateway = HttpGateway(url or self.url, keys, timeout=timeout, time_seen=time_seen)
        self.gateways.append(gateway)
        return gateway

    def _wechatpay_gateway(
        self,
        url: str | None,
        api_keys: Mapping[str, SecretStr],
        timeout: float,
        time_seen: TimeSeen | None = None,
    ) -> WechatPayGateway:
        """The WeChat Pay gateway; given keys other than the tenant's, it signs with a key the
        simulator does not know (as a wrong API key does elsewhere)."""
        assert self.wechatpay is not None
        merchant = self.wechatpay
        ours = self.tenant.api_key.get_secret_value()
        if any(key.get_secret_value() != ours for key in api_keys.values()):
            wrong = SecretStr(private_pem(rsa_key("impostor")))
            merchant = merchant.model_copy(update={"private_key": wrong})
        keys = {tenant: merchant_keys(tenant, merchant) for tenant in api_keys}

        base = (url or self.url) + WECHATPAY_PREFIX
        totals = self.control.order_total
        return WechatPayGateway(
            keys, order_totals=totals, api_base=base, timeout=timeout, time_seen=time_seen
        )

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.close()

    def check_truthful(self) -> None:
        """The invariant every rig test ends on (``tests.support.judge``)."""
        check_truthful(self.sessions, self.control)

    def reconciler(self, registry: KindRegistry | None = None, **kw: Any) -> Reconciler:
        kw.setdefault("client_timeout", 1.0)
        return Reconciler(
            sessions=self.sessions,
            gateway=self.gateway(),
            registry=registry or self.outbox.registry,
            worker=kw.pop("worker", "r1"),
            **kw,
        )

    def set(self, op_id: int, **values: Any) -> None:
        """Move an operation's timestamps (no sleeping: the test makes time pass)."""
        with self.sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id == op_id).values(**values))

    def age_attempts(self, op_id: int, seconds: float) -> None:
        """Make the operation's attempts (their start, lease end and outcome) ``seconds`` old."""
        ago = datetime.now(UTC) - timedelta(seconds=seconds)
        with self.sessions.begin() as s:
            attempts = update(Attempt).where(Attempt.operation_id == op_id)
            s.execute(attempts.values(started_at=ago, not_after=ago))
            s.execute(attempts.where(Attempt.finished_at.is_not(None)).values(finished_at=ago))

    def make_quiet(self, op_id: int) -> None:
        """Age the operation's attempts past quiescence: 60 s (beyond the client timeout plus
        the processing time), and where the kind's downstream does not enforce the deadline
        (Stripe's) beyond its delay bound too."""
        contract = self.outbox.registry.get(self.op(op_id).kind).contract
        bound = 0.0 if contract.enforces_deadline else contract.max_request_delay.total_seconds()
        self.age_attempts(op_id, 60 + bound)

    def enqueue(self, op_id: str = "op-1", params: dict[str, Any] | None = None, **kw: Any) -> int:
        with self.sessions.begin() as s:
            got = self.outbox.enqueue(
                s, tenant="acme", op_id=op_id, kind="refund", params=params or GOOD, **kw
            )
            return got.operation.id

    def enqueue_on_its_own_order(self, op_id: str) -> int:
        """``enqueue`` refunding an order of its own (made now in the simulator's ledger): a
        provider that looks refunds up by order (Stripe lists a payment intent's refunds) then
        asks about this operation alone."""
        order = f"A1042-{op_id}"
        self.control.create_order("acme", order, 100000)
        return self.enqueue(op_id, params={**GOOD, "order_id": order})

    def op(self, op_id: int) -> Operation:
        with self.sessions() as s:
            op = s.get(Operation, op_id)
            assert op is not None
            return op

    def attempts(self, op_id: int) -> list[Attempt]:
        with self.sessions() as s:
            stmt = select(Attempt).where(Attempt.operation_id == op_id).order_by(Attempt.number)
            return list(s.scalars(stmt))

    def effects(self, op_id: int) -> int:
        return self.control.effects("acme", self.op(op_id).idempotency_key)

    def sends(self, op_id: int) -> int:
        return self.control.requests("acme", self.op(op_id).idempotency_key)

    def reviews(self, op_id: int) -> list[ReviewItem]:
        with self.sessions() as s:
            return list(s.scalars(select(ReviewItem).where(ReviewItem.operation_id == op_id)))

    def downstream_reference(self, op_id: int) -> str:
        """The reference the downstream's record of the operation shows (its lookup), also
        where the record differs from the intent."""
        found = self.gateway().lookup(
            DownstreamRequest(
                "acme",
                self.op(op_id).op_id,
                self.outbox.registry.get("refund"),
                self.op(op_id).idempotency_key,
                self.op(op_id).params,
            ),
            deadline=datetime.now(UTC) + timedelta(seconds=5),
        )
        record = getattr(found, "receipt", None) or getattr(found, "record", None)
        assert isinstance(record, Receipt), found
        return record.reference

    def make_due(self, op_id: int) -> None:
        with self.sessions.begin() as s:
            s.execute(
                update(Operation)
                .where(Operation.id == op_id)
                .values(next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))
            )


def speak_stripe(rig: Rig) -> Rig:
    """Make ``rig``'s gateways Stripe gateways to the simulator's Stripe mode. Stripe ignores
    ``Settled-Deadline``: its contracts declare no fence (a "not found" waits out the delay
    bound)."""
    rig.stripe = True
    rig.outbox = replace(rig.outbox, registry=default_registry())
    return rig


def speak_wechatpay(rig: Rig) -> Rig:
    """Make ``rig``'s gateways WeChat Pay gateways to the simulator's WeChat Pay mode (the
    tenant registered as a merchant). WeChat Pay ignores ``Settled-Deadline``: its contracts
    declare no fence (a "not found" waits out the delay bound)."""
    rig.wechatpay = register(rig.url, rig.tenant.name)
    rig.outbox = replace(rig.outbox, registry=default_registry())
    return rig


def speak_alipay(rig: Rig) -> Rig:
    """Make ``rig``'s gateways Alipay gateways to the simulator's Alipay mode, the tenant's app
    registered with it; refunds under Alipay's contract (no fence: a "not found" waits out its
    processing time and delay bound)."""
    rig.alipay = register_app(rig.control, rig.tenant.name)
    registry = default_registry().with_contract("refund", **PROVIDER_CONTRACTS["alipay"])
    rig.outbox = replace(rig.outbox, registry=registry)
    return rig


#: Every provider mode of the simulator, each with what turns the rig's gateways to it: the
#: wire protocol's (``http``, the rig as it comes), Stripe's, WeChat Pay's and Alipay's.
PROVIDER_MODES: dict[str, Callable[[Rig], Rig]] = {
    "http": lambda rig: rig,
    "stripe": speak_stripe,
    "wechatpay": speak_wechatpay,
    "alipay": speak_alipay,
}


@pytest.fixture
def stripe_rig(rig: Rig) -> Rig:
    """The rig whose gateways are Stripe gateways to the simulator's Stripe mode."""
    return speak_stripe(rig)


@pytest.fixture
def wechatpay_rig(rig: Rig) -> Rig:
    """The rig whose gateways are WeChat Pay gateways to the simulator's WeChat Pay mode."""
    return speak_wechatpay(rig)


@pytest.fixture
def alipay_rig(rig: Rig) -> Rig:
    """The rig whose gateways are Alipay gateways to the simulator's Alipay mode."""
    return speak_alipay(rig)


@pytest.fixture(params=list(PROVIDER_MODES))
def provider_rig(request: pytest.FixtureRequest, rig: Rig) -> Rig:
    """The rig in each provider mode in turn (``PROVIDER_MODES``), judged by the same ledger at
    teardown; a test narrows the modes with ``indirect`` parametrisation of ``provider_rig``."""
    return PROVIDER_MODES[request.param](rig)


@pytest.fixture
def rig(
    engine: Engine,
    outbox: Outbox,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    simulator: SimulatorHandle,
) -> Iterator[Rig]:
    sim_control.create_order("acme", "A1042", 100000)
    rig = Rig(
        engine,
        outbox,
        sim_control,
        sim_tenant,
        simulator.url,
        sessionmaker(engine, expire_on_commit=False),
    )
    yield rig
    try:
        if rig.judged_by_ledger:
            rig.check_truthful()
    finally:
        rig.close()
