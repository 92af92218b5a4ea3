"""``settled run``'s supervisor: a child that dies after it said it was ready is restarted with
back-off; one that exits before it was ever ready (its preflight refused) stops them all, with
its exit status; a stop signal stops them all. The children are real processes."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from settled import supervise as supervise_module
from settled.supervise import supervise
from tests.support.services import wait_until


def stop_when(condition: Callable[[], bool]) -> None:
    """From a helper thread: SIGTERM this process (the supervisor) once ``condition`` holds."""

    def run() -> None:
        assert wait_until(condition, timeout=30)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=run, daemon=True).start()


def test_a_child_that_dies_is_restarted_with_back_off_and_the_others_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervise_module, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(supervise_module, "MAX_DELAY", 0.2)
    starts, pidfile = tmp_path / "starts", tmp_path / "sleeper.pid"
    sleeper = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pidfile)!r} + '.tmp', 'w').write(str(os.getpid())); "
        f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); time.sleep(60)",
    ]
    dies = [
        sys.executable,
        "-c",
        "import os; from settled.supervise import say_ready; say_ready(); "
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n'); raise SystemExit(3)",
    ]
    said: list[str] = []
    stop_when(lambda: starts.exists() and len(starts.read_text().split()) >= 5)
    supervise([sleeper, dies], poll=0.01, say=said.append)
    assert len(set(starts.read_text().split())) >= 5  # a new process each time
    # the last child may exit before the supervisor sees it die; it is then reported "while
    # stopping", without a restart: only the restart lines carry a delay
    delays = [m.rsplit("restarting in ", 1)[1] for m in said if "; restarting in " in m]
    assert delays[:4] == ["0.05 s", "0.1 s", "0.2 s", "0.2 s"]  # doubling, capped
    assert any("restarting" in m and "(restart 1)" in m for m in said)
    sleeper_pid = int(pidfile.read_text())
    assert not any(str(sleeper_pid) in m for m in said)
    assert not Path(f"/proc/{sleeper_pid}").exists()  # stopped with the rest, and reaped


def test_a_stop_signal_stops_every_child_and_succeeds(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    child = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pidfile)!r} + '.tmp', 'w').write(str(os.getpid())); "
        f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); time.sleep(60)",
    ]
    result: list[int] = []
    # supervise installs signal handlers, so it must run in the main thread; the signal is
    # sent from a helper thread once the child is up.

    def stop_when_child_is_up() -> None:
        assert wait_until(pidfile.exists, timeout=30)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_child_is_up, daemon=True).start()
    result.append(supervise([child], poll=0.05))
    assert result == [0]
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists()


READY_THEN_SLEEP = (
    "import os, sys, time; from settled.supervise import say_ready; say_ready(); "
    # written whole, then renamed: a reader that sees the file sees the pid in it
    "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)"
)


def test_a_child_that_exits_before_it_was_ready_stops_them_all_with_its_status(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "ready.pid"
    ready = [sys.executable, "-c", READY_THEN_SLEEP, str(pidfile)]
    # As a child whose preflight refused: it waits for the other to be up, then exits 1.
    refused = [
        sys.executable,
        "-c",
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "print('Error: refused', file=sys.stderr); raise SystemExit(4)",
        str(pidfile),
    ]
    said: list[str] = []
    assert supervise([ready, refused], poll=0.01, say=said.append) == 4
    assert any("exited with status 4 before it was ready; stopping" in m for m in said), said
    assert not any("restarting" in m for m in said), said  # never restarted
    assert not Path(f"/proc/{int(pidfile.read_text())}").exists()  # the other was stopped


def test_a_child_once_ready_is_restarted_even_when_a_restart_fails_before_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Healthy once: a database down at its restart is waited out, not a reason to stop."""
    monkeypatch.setattr(supervise_module, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(supervise_module, "MAX_DELAY", 0.1)
    starts = tmp_path / "starts"
    # Ready on its first start only; every start exits 3.
    child = [
        sys.executable,
        "-c",
        "import os, sys; from settled.supervise import say_ready\n"
        "first = not os.path.exists(sys.argv[1])\n"
        "open(sys.argv[1], 'a').write('x\\n')\n"
        "if first: say_ready()\n"
        "raise SystemExit(3)",
        str(starts),
    ]
    said: list[str] = []
    stop_when(lambda: starts.exists() and len(starts.read_text().split()) >= 4)
    supervise([child], poll=0.01, say=said.append)
    assert len(starts.read_text().split()) >= 4
    assert not any("before it was ready" in m for m in said), said


def test_a_child_that_will_not_stop_has_its_stacks_written_then_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(supervise_module, "STOP_SECONDS", 0.5)
    ready = tmp_path / "ready"
    stubborn = [
        sys.executable,
        "-c",
        "import faulthandler, signal, time; from settled.supervise import say_ready; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "faulthandler.register(signal.SIGUSR1, all_threads=True); say_ready(); "
        f"open({str(ready)!r}, 'w').write('1'); time.sleep(60)",
    ]
    said: list[str] = []
    stop_when(ready.exists)
    status = supervise([stubborn], poll=0.01, say=said.append)
    assert status == 1  # killed: not a clean stop
    assert any("did not stop within 0.5 s" in m for m in said), said
    assert any("exited with status -9 while stopping" in m for m in said), said
    assert "Current thread" in capfd.readouterr().err  # where it hung, from faulthandler
