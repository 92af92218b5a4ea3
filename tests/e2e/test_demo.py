"""``settled demo`` end to end: the embedded default, a real worker with beat, the simulator."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from settled.demo import Demo, WorkerStopped, run_demo

pytestmark = pytest.mark.slow


def running_with(path: str) -> list[str]:
    """Command lines of live processes that mention ``path``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if path in cmdline:
            found.append(cmdline)
    return found


# The Chinese runs send their refunds through the Stripe gateway (``--stripe``) and the WeChat
# Pay gateway (``--provider wechatpay``): the story and its checks are the same.
@pytest.mark.parametrize(
    ("lang", "provider"),
    [("en", "http"), ("zh", "stripe"), ("zh", "wechatpay")],
    ids=["en", "zh-stripe", "zh-wechatpay"],
)
def test_demo_runs_to_the_end_and_its_report_matches_the_ledger(
    tmp_path: Path, lang: str, provider: str
) -> None:
    stripe = provider == "stripe"
    chosen = ["--stripe"] if stripe else ["--provider", provider]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    result = subprocess.run(
        [sys.executable, "-m", "settled.cli", "demo", "--lang", lang, *chosen],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "kombu" not in result.stderr  # no "No hostname was supplied" as its first line
    assert "Nothing happened twice; the report matches the ledger." in out
    assert "MISMATCH" not in out
    assert ("Refunds go through the Stripe gateway" in out) is stripe
    assert ("Refunds go through the WeChat Pay gateway" in out) is (provider == "wechatpay")
    # The cases, each with its verdict.
    assert "op-9 with 20000 instead of 10000: refused [idempotency_conflict]" in out
    assert "original untouched: amount 10000, state succeeded" in out
    assert "path: planned -> submitted -> unknown -> succeeded" in out
    assert "in the review queue (lookup_unavailable)" in out
    stopped = re.search(r"stop pressed: (\d) planned refund\(s\) cancelled", out)
    assert stopped is not None
    assert int(stopped.group(1)) == 2  # both refunds that joined the run while one was in flight
    assert "compensation (cancel the ticket)" in out
    if lang == "en":
        assert "Stopped further processing, but the result of operation" in out
    else:
        assert "已停止继续处理，但操作" in out
    # The ledger beside the report: A1042 refunded 100 + 50, exactly once each.
    assert "'A1042': 15000" in out
    # It leaves nothing running, and nothing behind but its operations database ...
    folder = re.search(r"in (\S*settled-demo-\S+)", out)
    assert folder is not None
    kept = Path(folder.group(1))
    assert {p.name for p in kept.iterdir()} <= {
        "settled.sqlite3",
        "settled.sqlite3-wal",
        "settled.sqlite3-shm",
    }
    assert running_with(folder.group(1)) == []
    # The reconciler's lookup (in the worker's beat) went the way the flag says: the Stripe
    # gateway lists the payment intent's refunds; the wire protocol asks for the key.
    with closing(sqlite3.connect(kept / "settled.sqlite3")) as db:
        (evidence,) = db.execute("SELECT evidence FROM review_items").fetchone()
    detail = json.loads(evidence)["detail"]
    assert detail.startswith("listing refunds failed") is stripe, evidence
    # the WeChat Pay gateway queries the refund by its out_refund_no
    assert (detail == "the query answered HTTP 500 SYSTEM_ERROR") is (provider == "wechatpay")
    assert list(tmp_path.iterdir()) == []  # nothing written where it was started
    # ... for the review-queue command it prints, which works as printed.
    hint = re.search(r"SETTLED_DATABASE_URL=(\S+) settled (review list .*)", out)
    assert hint is not None
    listed = subprocess.run(
        [sys.executable, "-m", "settled.cli", *hint.group(2).split()],
        env={**env, "SETTLED_DATABASE_URL": hint.group(1)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert "lookup_unavailable" in listed.stdout
    assert listed.stdout.split()[:2] == ["ITEM", "TENANT"]  # a header above the columns
    shutil.rmtree(kept)


def test_demo_whose_worker_stops_fails_at_once_with_the_worker_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("SETTLED_")]:
        monkeypatch.delenv(name)

    folder = tmp_path / "demo"
    log = folder / "worker.log"

    def worker_stops(self: Demo) -> None:
        assert self.worker is not None
        self.wait("the worker to start", lambda: "settled worker: database" in log.read_text())
        self.worker.terminate()  # as a worker that stops on an unrecoverable error
        self.wait("a refund", lambda: False)  # unchecked, it would time out (WAIT_SECONDS)

    monkeypatch.setattr(Demo, "two_refunds", worker_stops)
    lines: list[str] = []
    with pytest.raises(WorkerStopped, match=r"the worker stopped \(exit status -?\d+\)"):
        run_demo(keep=str(folder), echo=lines.append)
    out = "\n".join(lines)
    assert "The worker's log, its last" in out, out
    assert "settled worker: database" in out  # the worker's first line, printed
    assert running_with(str(folder)) == []
