"""An adapter still written with the six keywords of earlier releases keeps working for one
release: the services tell it by its signature when they are built, warn once, and call it the
old way (``outbox.port_shim.as_gateway``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Settings, new_op_id, upgrade
from outbox.downstream import (
    Unknown,
)
from outbox.port_shim import OldStyleGateway
from reconciler.reconcile import Reconciler
from settled.runtime import Runtime, build_runtime
from tests.support.old_style import OldStyle
from workers.executor import Executor

PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
OLD_FORM = r"OldStyle.lookup and OldStyle.submit take the old keywords"
NEW_FORM = r"submit\(self, request: DownstreamRequest, \*, deadline\)"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    upgrade(url)
    return Settings(
        database_url=url,
        fingerprint_keys={"v1": "test-fingerprint-key-0001"},  # type: ignore[dict-item]
        idempotency_secret="test-idempotency-secret",  # type: ignore[arg-type]
    )


@pytest.fixture
def old() -> OldStyle:
    return OldStyle()


@pytest.fixture
def runtime(settings: Settings, old: OldStyle) -> Iterator[Runtime]:
    with pytest.warns(DeprecationWarning, match=OLD_FORM) as told:
        rt = build_runtime(settings, gateway=old)
    assert len([w for w in told if w.category is DeprecationWarning]) == 1  # once, not per service
    assert NEW_FORM.replace("\\", "") in str(told[0].message)
    try:
        yield rt
    finally:
        rt.close()


def enqueue(rt: Runtime) -> tuple[int, str]:
    with rt.sessions.begin() as session:
        op = rt.outbox.enqueue(
            session, tenant="acme", op_id=new_op_id(), kind="refund", params=PARAMS
        ).operation
    return op.id, op.idempotency_key


def test_an_old_style_adapter_sends_and_is_looked_up_through_the_runtime(
    runtime: Runtime, old: OldStyle
) -> None:
    old.fake.script_submit(Unknown("read timeout"), executed=True)  # done, the answer lost
    op, key = enqueue(runtime)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning once built: not one per call
        assert runtime.executor.execute([op])[op].value == "unknown"
        assert runtime.reconciler.run_once().outcomes == {"found": 1}
    assert old.given == [("submit", dict), ("lookup", dict)]  # the old way: a dict, as before
    assert old.fake.effects("acme", key) == 1
    assert isinstance(runtime.gateway, OldStyleGateway)
    assert runtime.executor.gateway is runtime.gateway is runtime.reconciler.gateway
    assert runtime.review.gateway is runtime.gateway


def test_an_executor_and_a_reconciler_built_by_hand_take_an_old_style_adapter(
    runtime: Runtime, old: OldStyle
) -> None:
    with pytest.warns(DeprecationWarning, match=OLD_FORM) as told:
        executor = Executor(
            sessions=runtime.sessions,
            gateway=old,
            registry=runtime.registry,
            fingerprinter=runtime.outbox.fingerprinter,
            worker="w1",
        )
    assert len(told) == 1 and told[0].filename == __file__  # it names the line that built it
    with pytest.warns(DeprecationWarning, match=OLD_FORM):
        reconciler = Reconciler(
            sessions=runtime.sessions, gateway=old, registry=runtime.registry, worker="r1"
        )
    old.fake.script_submit(Unknown("read timeout"), executed=True)
    op, key = enqueue(runtime)
    assert executor.execute([op])[op].value == "unknown"
    assert reconciler.run_once().outcomes == {"found": 1}
    assert [call.method for call in old.fake.calls] == ["submit", "lookup"]
    assert old.fake.effects("acme", key) == 1
    executor.close()
    reconciler.close()
