"""``settled demo --provider alipay``: the Chinese story with its refunds through the Alipay
gateway to the simulator's Alipay mode (signed form requests, signed answers), its report
matching the ledger, and the reconciler's lookup the refund query."""

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

from tests.e2e.test_demo import running_with


def test_the_zh_story_through_alipay_matches_the_ledger(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    result = subprocess.run(
        [sys.executable, "-m", "settled.cli", "demo", "--lang", "zh", "--provider", "alipay"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "Refunds go through the Alipay gateway to the simulator's Alipay mode" in out
    assert "Nothing happened twice; the report matches the ledger." in out
    assert "MISMATCH" not in out
    assert "op-9 with 20000 instead of 10000: refused [idempotency_conflict]" in out
    assert "path: planned -> submitted -> unknown -> succeeded" in out
    assert "in the review queue (lookup_unavailable)" in out
    assert "已停止继续处理，但操作" in out
    assert "'A1042': 15000" in out
    folder = re.search(r"in (\S*settled-demo-\S+)", out)
    assert folder is not None
    kept = Path(folder.group(1))
    assert running_with(folder.group(1)) == []
    # The lookup that could not be answered was Alipay's refund query (answered 20000).
    with closing(sqlite3.connect(kept / "settled.sqlite3")) as db:
        (evidence,) = db.execute("SELECT evidence FROM review_items").fetchone()
    assert json.loads(evidence)["detail"].startswith("the refund query answered 20000"), evidence
    # A receipt of Alipay's: the trade number and our refund number.
    with closing(sqlite3.connect(kept / "settled.sqlite3")) as db:
        refs = [r for (r,) in db.execute("SELECT downstream_ref FROM operations") if r]
    assert any(re.fullmatch(r"2026\d{24}:stl_[a-z2-7]{36}", ref) for ref in refs), refs
    shutil.rmtree(kept)
