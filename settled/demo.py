"""``settled demo``: the whole job on the embedded default, live, in well under a minute.

An SQLite file, Celery's filesystem broker, a real worker (solo pool) with beat, and the
payment simulator on a local port; all started and stopped here. It plays the cases a payment
team meets, prints the report of every run, and the simulator's ledger beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import SecretStr

from outbox import relay
from outbox.db import upgrade
from outbox.errors import IdempotencyConflict
from outbox.ids import derive_idempotency_key, new_op_id
from outbox.kinds import default_registry
from outbox.models import Operation
from outbox.relay import Publish
from outbox.report import render
from outbox.report_text import Lang, check_lang
from outbox.runs import cancel_run, compensate, find_run, open_run, run_report
from outbox.settings import ContractSettings, Settings
from outbox.settings_wechatpay import WechatPayMerchant
from outbox.storage.events import states_passed
from outbox.storage.operations import all_operations, find_operation
from outbox.storage.reviews import review_reason
from settled.celery_app import create_app, hint_publisher
from settled.runtime import Runtime, build_runtime
from settled.simulator import SimulatorControl, start_in_thread
from settled.simulator.alipay import GATEWAY as ALIPAY_GATEWAY
from settled.simulator.control import order_total

TENANT = "acme"
API_KEY = "sk_test_demo_acme"
#: The demo's WeChat Pay merchant (its key pair is made at each start).
MCHID, MERCHANT_SERIAL = "1900000109", "DEMO0000000000000000000000000000000001"
TERMINAL = ("succeeded", "rejected", "cancelled")

Echo = Callable[[str], None]


#: How long the demo waits for a step: far above what one takes (a few seconds; the first,
#: which waits for the worker to start, up to 15 s on a machine whose cores are busy with other
#: work). A worker that stops ends the wait at once (``WorkerStopped``).
WAIT_SECONDS = 90.0
#: How many of the worker log's last lines the demo prints when a step does not come
LOG_TAIL_LINES = 40


class WorkerStopped(RuntimeError):
    """The demo's worker ended while the demo waited for it."""


@dataclass
class Demo:
    rt: Runtime
    control: SimulatorControl
    publish: Publish
    echo: Echo
    started: float = field(default_factory=time.monotonic)
    lang: Lang = "en"
    handles: list[tuple[str, str]] = field(default_factory=list)  # (title, handle)
    #: the worker process, watched while the demo waits (None: not watched)
    worker: subprocess.Popen[bytes] | None = None

    # -- helpers ---------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.echo(f"[{time.monotonic() - self.started:5.1f}s] {text}")

    def key(self, op_id: str) -> str:
        return derive_idempotency_key(self.rt.outbox.idempotency_secret, TENANT, op_id)

    def refund(
        self, session: Any, order: str, amount: int, *, op_id: str | None = None, run: Any = None
    ) -> Operation:
        params = {"order_id": order, "amount_minor": amount, "currency": "CNY", "payee": "P-7"}
        return self.rt.outbox.enqueue(
            session,
            tenant=TENANT,
            op_id=op_id or new_op_id(),
            kind="refund",
            params=params,
            run=run,
        ).operation

    def state(self, op_id: str) -> Operation:
        with self.rt.sessions() as s:
            op = find_operation(s, TENANT, op_id)
            assert op is not None
            return op

    def wait(self, what: str, check: Callable[[], bool], timeout: float = WAIT_SECONDS) -> None:
        end = time.monotonic() + timeout
        while not check():
            status = None if self.worker is None else self.worker.poll()
            if status is not None:  # nothing will come: say so now, not after the timeout
                raise WorkerStopped(
                    f"demo: the worker stopped (exit status {status}) while waiting for {what}"
                )
            if time.monotonic() > end:
                raise TimeoutError(f"demo: timed out waiting for {what}")
            time.sleep(0.1)

    def wait_state(self, op_id: str, *states: str, timeout: float = WAIT_SECONDS) -> Operation:
        self.wait(f"{op_id} to be {'/'.join(states)}", lambda: self.state(op_id).state in states,
                  timeout)  # fmt: skip
        return self.state(op_id)

    def path(self, operation_id: int) -> list[str]:
        """The states an operation went through, from its event log."""
        with self.rt.sessions() as s:
            return states_passed(s, operation_id)

    def show(self, op: Operation, label: str) -> None:
        ref = f" (receipt {op.downstream_ref})" if op.downstream_ref else ""
        reason = f" [{op.reason}]" if op.reason else ""
        self.say(f"  {label}: {op.op_id} -> {op.state}{reason}{ref}")

    # -- the cases -------------------------------------------------------------------------

    def two_refunds(self) -> None:
        self.say("1. Order A1042 is refunded 100.00 and then 50.00 CNY: two operations")
        self.control.create_order(TENANT, "A1042", 30000, "CNY")
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="Refunds on order A1042")
            first = self.refund(s, "A1042", 10000, run=run).op_id
            second = self.refund(s, "A1042", 5000, run=run).op_id
            self.handles.append(("Refunds on order A1042", run.handle))
        for op_id, label in ((first, "refund 100.00"), (second, "refund 50.00")):
            self.show(self.wait_state(op_id, *TERMINAL), label)

    def replay_and_conflict(self) -> None:
        self.say("2. op-9 is sent, replayed, then re-sent with another amount")
        self.control.create_order(TENANT, "B2001", 30000, "CNY")
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="Refund op-9 on order B2001")
            self.refund(s, "B2001", 10000, op_id="op-9", run=run)
            self.handles.append(("Refund op-9 on order B2001", run.handle))
        self.show(self.wait_state("op-9", *TERMINAL), "op-9 (10000)")
        with self.rt.sessions.begin() as s:
            replay = self.rt.outbox.enqueue(
                s,
                tenant=TENANT,
                op_id="op-9",
                kind="refund",
                params={"order_id": "B2001", "amount_minor": 10000, "currency": "CNY",
                        "payee": "P-7"},
            )  # fmt: skip
            self.say(
                f"  replay of op-9: same operation (created={replay.created}), "
                f"state {replay.operation.state}, receipt {replay.operation.downstream_ref}"
            )
        try:
            with self.rt.sessions.begin() as s:
                self.refund(s, "B2001", 20000, op_id="op-9")
        except IdempotencyConflict as exc:
            self.say(f"  op-9 with 20000 instead of 10000: refused [{exc.code}]")
        op = self.state("op-9")
        self.say(f"  original untouched: amount {op.params['amount_minor']}, state {op.state}")

    def lost_response(self) -> None:
        self.say("3. A refund whose response is lost after the payment service committed it")
        self.control.create_order(TENANT, "D4004", 30000, "CNY")
        op_id = new_op_id()
        self.control.add_rule("commit_then_timeout", self.key(op_id), hold_seconds=10)
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="Refund on order D4004 (response lost)")
            self.refund(s, "D4004", 8000, op_id=op_id, run=run)
            self.handles.append(("Refund on order D4004 (response lost)", run.handle))
        op = self.wait_state(op_id, *TERMINAL)
        self.say(f"  path: {' -> '.join(self.path(op.id))}")
        self.show(op, "settled by the reconciler's lookup")

    def lookup_down(self) -> None:
        self.say("4. The same, but the lookup API is down: the operation goes to review")
        self.control.create_order(TENANT, "E5005", 30000, "CNY")
        op_id = new_op_id()
        key = self.key(op_id)
        self.control.add_rule("commit_then_timeout", key, hold_seconds=10)
        self.control.add_rule("lookup_unavailable", key)
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="Refund on order E5005 (lookup down)")
            op = self.refund(s, "E5005", 6000, op_id=op_id, run=run)
            self.handles.append(("Refund on order E5005 (lookup down)", run.handle))
            op_pk = op.id

        def in_review() -> bool:
            with self.rt.sessions() as s:
                return review_reason(s, op_pk) is not None

        try:
            self.wait("a review item", in_review)
        except TimeoutError as exc:  # say where it stands: still planned, unknown, ...
            raise TimeoutError(f"{exc} (the refund is {self.state(op_id).state})") from None
        with self.rt.sessions() as s:
            reason = review_reason(s, op_pk)
        self.show(self.state(op_id), f"in the review queue ({reason})")

    def stop_button(self) -> None:
        self.say("5. A run of three refunds; the user presses stop while one is in flight")
        self.control.create_order(TENANT, "C3003", 30000, "CNY")
        held, *later = [new_op_id() for _ in range(3)]
        # The first refund is held by the payment service until stop is pressed.
        self.control.add_rule("hold_before_commit", hold_seconds=30, times=1)
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="Refund three items on order C3003")
            self.refund(s, "C3003", 3000, op_id=held, run=run)
            handle = run.handle
            self.handles.append(("Refund three items on order C3003", handle))
        self.wait("a refund in flight", lambda: self.control.in_flight(TENANT, self.key(held)))
        # The other two join the run and stop is pressed in one transaction: the worker, whose
        # send of the first is cut off by its client timeout, never sees them not cancelled,
        # however slow the machine (pressed in a transaction of its own, a stop later than
        # that timeout found them sent).
        with self.rt.sessions.begin() as s:
            run = find_run(s, TENANT, handle)
            for op_id, amount in zip(later, (2000, 1000), strict=True):
                self.refund(s, "C3003", amount, op_id=op_id, run=run)
            stopped = cancel_run(s, TENANT, handle, actor="user")
        self.say(f"  stop pressed: {len(stopped.cancelled_ids)} planned refund(s) cancelled")
        # The report as the user sees it on pressing stop, before the held refund may finish
        # (released first, a quick worker could settle it before the report is read).
        with self.rt.sessions() as s:
            self.echo(_indent(render(run_report(s, TENANT, handle), self.lang)))
        self.control.release_holds()
        self.show(self.wait_state(held, *TERMINAL), "the refund in flight, settled later")

    def after_sales(self) -> None:
        self.say("6. After-sales: ticket created, pickup scheduling fails, compensation cancels it")
        self.control.create_order(TENANT, "F6006", 30000, "CNY")
        self.control.add_rule("business_reject", kind="pickup", code="no_courier_slot")
        with self.rt.sessions.begin() as s:
            run = open_run(s, tenant=TENANT, title="After-sales for order F6006")
            ticket = self.rt.outbox.enqueue(
                s, tenant=TENANT, op_id=new_op_id(), kind="after_sales_ticket", run=run,
                params={"ticket_id": "T-F6006", "order_id": "F6006", "reason": "damaged"},
            ).op_id  # fmt: skip
            self.handles.append(("After-sales for order F6006", run.handle))
            run_id = run.id
        self.show(self.wait_state(ticket, *TERMINAL), "ticket")
        with self.rt.sessions.begin() as s:
            run_obj = s.get(type(run), run_id)
            pickup = self.rt.outbox.enqueue(
                s, tenant=TENANT, op_id=new_op_id(), kind="pickup", run=run_obj,
                params={"ticket_id": "T-F6006", "day": "2026-12-02", "slot": "morning"},
            ).op_id  # fmt: skip
        self.show(self.wait_state(pickup, *TERMINAL), "pickup")
        with self.rt.sessions.begin() as s:
            original = find_operation(s, TENANT, ticket)
            assert original is not None
            undo = compensate(
                self.rt.outbox, s, original, op_id=new_op_id(), kind="ticket_cancel",
                params={"ticket_id": "T-F6006", "reason": "pickup_failed"},
            ).op_id  # fmt: skip
        self.show(self.wait_state(undo, *TERMINAL), "compensation (cancel the ticket)")

    # -- the end ---------------------------------------------------------------------------

    def reports(self) -> None:
        self.echo("")
        self.echo("=" * 78)
        with self.rt.sessions() as s:
            for title, handle in self.handles:
                self.echo(f"Run: {title}")
                self.echo(_indent(render(run_report(s, TENANT, handle), self.lang)))
                self.echo("")

    def ledger(self) -> bool:
        """Print every operation beside the simulator's ledger; True when they agree."""
        self.echo("Operations beside the payment service's ledger (effects per idempotency key):")
        self.echo(f"  {'op_id':<30} {'kind':<20} {'state':<10} {'effects':>7}  check")
        agree = True
        with self.rt.sessions() as s:
            ops = all_operations(s)
        for op in ops:
            effects = self.control.effects(TENANT, op.idempotency_key)
            if op.state == "succeeded":
                ok = effects == 1
            elif op.state in ("rejected", "cancelled"):
                ok = effects == 0
            else:  # uncertain: the ledger may hold it or not, but never twice
                ok = effects <= 1
            agree &= ok
            self.echo(
                f"  {op.op_id:<30} {op.kind:<20} {op.state:<10} {effects:>7}  "
                f"{'ok' if ok else 'MISMATCH'}"
            )
        refunded = {o["order_id"]: o["refunded_minor"] for o in self.control.ledger()["orders"]}
        self.echo(f"  refunded per order (minor units): {refunded}")
        self.echo("Nothing happened twice; the report matches the ledger." if agree
                  else "MISMATCH between the report and the ledger.")  # fmt: skip
        return agree


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the worker's log, to print when a step does not come."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"The worker's log ({path}) cannot be read: {exc}"
    tail = text.splitlines()[-lines:]
    return f"The worker's log, its last {len(tail)} lines ({path}):\n" + _indent("\n".join(tail))


@contextmanager
def _worker(settings: Settings, folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = (folder / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "settled.cli", "worker", "--pool=solo", "--beat",
         "--loglevel=WARNING"],
        env={**_base_env(), **settings.as_environment()},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}


#: The demo's ``SETTLED_WECHATPAY_ORDER_TOTALS`` before it moved to the simulator's client
#: (``settled.simulator.control:order_total``), kept for settings that name it.
simulator_order_total = order_total


def _wechatpay_merchant(control: SimulatorControl) -> WechatPayMerchant:
    """The demo's merchant, its key pair made now, registered with the simulator."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    serial, platform = control.add_wechatpay_merchant(
        TENANT, MCHID, MERCHANT_SERIAL, public.decode()
    )
    return WechatPayMerchant(
        mchid=MCHID,
        serial_no=MERCHANT_SERIAL,
        private_key=SecretStr(private.decode()),
        platform_serial=serial,
        platform_public_key=platform,
    )


#: What each provider's refunds go through, as the demo says it.
PROVIDERS = {
    "stripe": ("Stripe", "/stripe"),
    "wechatpay": ("WeChat Pay", "/wechatpay"),
    "alipay": ("Alipay", ALIPAY_GATEWAY),
}


def run_demo(
    *,
    lang: str = "en",
    keep: str | None = None,
    echo: Echo = print,
    stripe: bool = False,
    provider: str = "http",
) -> int:
    """Play every case; return 0 when the reports match the simulator's ledger. ``provider``
    (``stripe``: the same as ``provider="stripe"``): refunds go through that provider's
    gateway to the simulator's mode of it (``http``: the wire protocol)."""
    provider = "stripe" if stripe else provider
    alipay = _demo_alipay_app() if provider == "alipay" else None
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="settled-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    sim = start_in_thread(
        ledger=str(folder / "simulator.sqlite3"), test_mode=True, tenants={TENANT: API_KEY}
    )
    merchants: dict[str, WechatPayMerchant] = {}
    if provider == "wechatpay":
        with SimulatorControl(sim.url) as control:
            merchants[TENANT] = _wechatpay_merchant(control)
    db_url = f"sqlite:///{folder / 'settled.sqlite3'}"
    settings = Settings(
        database_url=db_url,
        broker_url="filesystem://",
        broker_folder=str(folder / "broker"),
        beat_schedule_file=str(folder / "celerybeat-schedule"),
        downstream_url=sim.url,
        downstream_api_keys={TENANT: SecretStr(API_KEY)},
        downstream_timeout=2.0,
        lease_seconds=5.0,
        sweep_seconds=0.3,
        reconcile_seconds=0.5,
        review_after_seconds=3.0,
        # No due operations claimed beside a hinted one (the default claims 8): with the one
        # operation per hint below, the worker takes a run's refunds one at a time, so the stop
        # button (case 5) finds the later ones still planned.
        claim_batch=0,
        downstream_providers={"refund": provider} if provider != "http" else {},
        # The simulator refuses requests that arrive past their deadline; Stripe, WeChat Pay
        # and Alipay (and the simulator's modes of them) do not, so refunds sent there wait out the
        # delay bound.
        downstream_contracts={
            name: ContractSettings(enforces_deadline=True)
            for name in default_registry().names()
            if not (provider != "http" and name == "refund")
        },
        stripe_api_keys={TENANT: SecretStr(API_KEY)},
        stripe_api_base=sim.url + "/stripe",
        wechatpay_merchants=merchants,
        wechatpay_api_base=sim.url + "/wechatpay",
        wechatpay_order_totals="settled.simulator.control:order_total",
        **(_alipay_settings(alipay, sim.url) if alipay is not None else {}),
    )
    echo(f"Settled demo: SQLite + filesystem broker + one worker with beat, in {folder}")
    if provider in PROVIDERS:
        name, prefix = PROVIDERS[provider]
        mode = f"{sim.url}{prefix}"
        echo(f"Refunds go through the {name} gateway to the simulator's {name} mode: {mode}")
    try:
        upgrade(db_url)
        rt = build_runtime(settings)
        celery = create_app(settings)
        # One operation per hint (and claim_batch=0 above): the solo worker then takes a run's
        # refunds one at a time, so the stop button (case 5) finds the later ones still planned.
        relay.install(rt.sessions, hint_publisher(celery), per_message=1, observer=rt.observer)
        control = SimulatorControl(sim.url)
        if alipay is not None:  # the app's public key, as a merchant uploads it to Alipay
            control.add_alipay_app(TENANT, ALIPAY_APP_ID, alipay[1])
        try:
            with _worker(settings, folder) as worker:
                demo = Demo(
                    rt, control, hint_publisher(celery), echo, lang=check_lang(lang),
                    worker=worker,
                )  # fmt: skip
                try:
                    demo.two_refunds()
                    demo.replay_and_conflict()
                    demo.lost_response()
                    demo.lookup_down()
                    demo.stop_button()
                    demo.after_sales()
                except (TimeoutError, WorkerStopped):  # the worker's log says why, kept or not
                    echo(_log_tail(folder / "worker.log"))
                    raise
                demo.reports()
                agree = demo.ledger()
        finally:
            control.close()
            celery.close()
            rt.close()
    finally:
        sim.stop()
        if not keep:
            _keep_only_the_database(folder)
    echo(
        "The review queue of this demo, as support staff see it:\n"
        f"  SETTLED_DATABASE_URL={db_url} settled review list --staff you --role viewer"
    )
    return 0 if agree else 1


#: The demo's Alipay app id (the simulator's Alipay mode knows it once registered).
ALIPAY_APP_ID = "2021000000000001"


def _demo_alipay_app() -> tuple[str, str]:
    """A fresh RSA key pair for the demo's Alipay app: (private PEM, public PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private.decode("ascii"), public.decode("ascii")


def _alipay_settings(app: tuple[str, str], sim_url: str) -> dict[str, Any]:
    """The demo tenant's Alipay app as settings: its keys, the simulator's Alipay public key
    (asked of the simulator: its key pair is made at first use) and the mode's gateway."""
    with SimulatorControl(sim_url) as control:
        alipay_public = control.alipay_public_key()
    return {
        "alipay_app_ids": {TENANT: ALIPAY_APP_ID},
        "alipay_private_keys": {TENANT: SecretStr(app[0])},
        "alipay_public_keys": {TENANT: alipay_public},
        "alipay_gateway_url": sim_url + ALIPAY_GATEWAY,
    }


def _keep_only_the_database(folder: Path) -> None:
    """Remove what the demo wrote except its operations database, which the review-queue
    hint it prints reads."""
    for path in folder.iterdir():
        if path.name.startswith("settled.sqlite3"):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
