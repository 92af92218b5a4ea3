"""``settled run``'s supervisor: one child dying stops the rest and fails the run."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from tests.support.services import wait_until
from workers.supervise import supervise


def test_one_child_dying_stops_the_others_and_fails(tmp_path: Path) -> None:
    pidfile = tmp_path / "sleeper.pid"
    sleeper = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    ]
    dies = [
        sys.executable,
        "-c",
        f"import os, time\nwhile not os.path.exists({str(pidfile)!r}): time.sleep(0.01)\n"
        "raise SystemExit(3)",
    ]
    assert supervise([sleeper, dies], poll=0.05) == 1
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists()  # terminated and reaped


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
