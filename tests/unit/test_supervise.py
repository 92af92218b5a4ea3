"""``settled run``'s supervisor: a child that dies is restarted with back-off; a stop signal
stops them all."""

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
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    ]
    dies = [
        sys.executable,
        "-c",
        f"import os; open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n'); raise SystemExit(3)",
    ]
    said: list[str] = []
    stop_when(lambda: starts.exists() and len(starts.read_text().split()) >= 5)
    supervise([sleeper, dies], poll=0.01, say=said.append)
    assert len(set(starts.read_text().split())) >= 5  # a new process each time
    delays = [m.rsplit("restarting in ", 1)[1] for m in said if "exited with status 3" in m]
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
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
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
