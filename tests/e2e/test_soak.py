"""The fault soak, short: about 1,000 operations through worker, beat, Redis and PostgreSQL
kills and a faulty downstream (``bench/soak.py``), so that every change is soaked.

The seed is fixed (``SETTLED_TEST_SOAK_SEED`` chooses another); a failure names it, and
``python bench/soak.py --ops 1000 --duration 40 --seed <seed>`` repeats the same schedule of
faults and kills. The soak must also have done what it says: every kind of kill and every
downstream fault happened at least once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak_plan import DOWNSTREAM_KINDS, KILLS

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("SETTLED_TEST_SOAK_SEED", "15"))
OPS = 1000


@pytest.mark.timeout(480)
def test_a_short_fault_soak_has_no_duplicate_no_loss_no_lie(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SETTLED_") or k.startswith("SETTLED_TEST_")
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--ops", str(OPS), "--duration", "40",
         "--seed", str(SEED), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
        cwd=tmp_path,
        check=False,
    )  # fmt: skip
    said = (
        f"soak seed {SEED} (repeat: SETTLED_TEST_SOAK_SEED={SEED}, or python bench/soak.py --ops "
        f"{OPS} --duration 40 --seed {SEED}); output in {out}\n"
        f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
    assert done.returncode == 0, said
    for row in ("duplicates", "lost", "lies"):
        assert re.search(rf"^{row} \(.*\)\s+0$", done.stdout, re.MULTILINE), said

    report = json.loads((out / "report.json").read_text())
    assert report["passed"], said
    assert (report["duplicates"], report["lost"], report["lies"]) == (0, 0, 0), said
    assert report["phantom_effects"] == 0, said
    assert report["operations"] == OPS, said
    assert report["seconds_from_last_fault_to_settled"] <= 60, said
    sends = report["sends"]
    assert sends["attempt_rows_above_max_attempts"] == 0, said
    assert sends["submits_above_max_attempts"] == 0, said
    # It did what it says: every kind of kill, every downstream fault, an outage of lookups.
    missing_kills = [k for k in KILLS if report["kills"][k] < 1]
    assert not missing_kills, said
    missing_faults = [f for f in DOWNSTREAM_KINDS if report["downstream_faults"][f] < 1]
    assert not missing_faults, said
    assert report["lookup_outages"] >= 1, said
    assert set(report["operations_by_kind"]) == {
        "refund", "after_sales_ticket", "pickup", "ticket_cancel",
    }, said  # fmt: skip
    assert report["transactions"]["cancels"] > 0, said
    assert report["transactions"]["batch"] > 0, said
    assert report["transactions"]["single"] > 0, said
    timeline = (out / "timeline.jsonl").read_text().splitlines()
    assert {json.loads(line)["kind"] for line in timeline} >= {*KILLS, "restart", "faults_end"}
