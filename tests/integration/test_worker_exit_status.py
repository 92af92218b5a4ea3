"""``settled worker`` and ``settled beat`` end with a non-zero status whenever they end abnormally,
so that systemd's ``Restart=on-failure``, supervisord and Docker's ``restart: on-failure`` restart
them; a stop signal still ends them with 0.

The processes are the real command line on the embedded default (SQLite file, filesystem broker),
with a fault injected by ``tests/support/faulty_cli.py``.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.simtools import wait_until
from tests.support.stack import Stack, embedded_stack

pytestmark = [pytest.mark.slow]

FAULTY_CLI = str(Path(__file__).parents[1] / "support" / "faulty_cli.py")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with embedded_stack(tmp_path) as s:
        yield s


def test_worker_whose_consumer_raises_exits_non_zero(stack: Stack) -> None:
    proc = stack.start(
        "consumer_raises", "worker", "--pool=solo", "--loglevel=INFO", launcher=[FAULTY_CLI]
    )
    status = proc.wait(120)
    log = stack.log_of(proc)
    assert "Unrecoverable error" in log, log[-4000:]
    assert "InjectedFault" in log
    assert status != 0, log[-4000:]  # was 0: the status Celery returned was dropped


def test_prefork_worker_whose_consumer_raises_exits_non_zero(stack: Stack) -> None:
    proc = stack.start(
        "consumer_raises", "worker", "--pool=prefork", "--concurrency=1", launcher=[FAULTY_CLI]
    )
    status = proc.wait(120)
    log = stack.log_of(proc)
    assert "Unrecoverable error" in log, log[-4000:]
    assert status != 0, log[-4000:]


def test_beat_whose_scheduler_raises_exits_non_zero(stack: Stack) -> None:
    proc = stack.start("scheduler_raises", "beat", launcher=[FAULTY_CLI])
    status = proc.wait(120)
    log = stack.log_of(proc)
    assert "InjectedFault" in log, log[-4000:]
    assert status != 0, log[-4000:]


def test_worker_stopped_by_sigterm_exits_zero(stack: Stack) -> None:
    proc = stack.start_worker(pool="solo")
    wait_until(lambda: "ready." in stack.log_of(proc), 60, "the worker is ready")
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0, stack.log_of(proc)[-4000:]
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not stop on SIGTERM")
