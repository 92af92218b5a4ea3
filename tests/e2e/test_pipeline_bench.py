"""The pipeline benchmark (``bench/pipeline.py``) in a tiny configuration: every phase runs, every
system of the live-traffic and open-loop phases is judged correct (one effect at the simulator
and one receipt per refund), and the table has every figure of issues 17 and 31 beside its
target.

The figures themselves are never asserted: a tiny run on a busy machine measures little, and
the targets are for a full run on a quiet one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--ops", "100", "--single-ops", "100", "--producers", "2", "--latency-ops", "50",
    "--idle-ops", "5", "--warmup", "5", "--noop-tasks", "100", "--raw-ops", "100",
    "--sim-requests", "100", "--concurrency", "2", "--scan-small", "1200",
    "--scan-large", "5000", "--scan-live", "100", "--scan-due", "10", "--scan-repeats", "2",
    "--live-seconds", "1.5", "--open-rates", "50", "--open-seconds", "1",
]  # fmt: skip

#: The rows that carry a target, in order: (figure, target), as regular expressions.
TARGETS = [
    (r"Settled, refunds/s reaching succeeded", r">= \d+ \(0\.6 × stock Celery no-op, live\)"),
    (r"  ÷ stock Celery no-op, live", r">= 0\.60"),
    (r"  ÷ plain Celery safe, live", r">= 1\.20"),
    (r"Settled commit → receipt p50", r"<= [\d.]+ ms \(1\.5 × plain Celery safe\)"),
    (r"Settled commit → receipt p99", r"<= 50 ms"),
    (r"Settled worker CPU per refund", r"<= [\d.]+ ms \(1\.2 × plain Celery safe\)"),
    (r"Settled worker write transactions per refund", r"<= 2\.0"),
    (
        r"drained backlog, one op per intake commit, 2 producer processes, ops/s",
        r">= \d+ \(0\.6 × stock no-op",
    ),
    (r"  ÷ stock Celery no-op drain", r">= 0\.60 \(stretch 0\.80\)"),
    (
        r"drained backlog, 100 ops per intake commit \(batched\), ops/s",
        r">= \d+ \(0\.8 × stock no-op\)",
    ),
    (r"  ÷ stock Celery no-op drain", r">= 0\.80"),
    (r"p50 at \d+ ops/s \(half the single-commit max, one per commit\)", r"<= 20 ms"),
    (r"p99 at \d+ ops/s", r"<= 100 ms"),
    (r"one op alone on an idle system, p50", r"<= [\d.]+ ms \(2 × Celery's publish-to-start\)"),
    (r"one op per intake commit", r"<= 2\.2"),
    (r"sweeper pass, 5,000 operations", r"<= [\d.]+ ms"),
    (r"  large ÷ small", r"<= 2"),
    (r"reconciler pass, 5,000 operations", r"<= [\d.]+ ms"),
    (r"  large ÷ small", r"<= 2"),
]

#: Reference rows the issue names beside the targets.
REFERENCES = [
    r"stock Celery no-op, live, tasks/s",
    r"plain Celery safe, live, refunds/s",
    r"plain Celery safe commit → receipt p50",
    r"plain Celery safe worker CPU per refund",
    r"plain Celery safe worker write transactions per refund",
    r"  Settled producers' CPU per refund \(app side\)",
    r"no-op drain, stock Celery \(kombu's Redis transport\), tasks/s",
    r"no-op drain, the product's Celery configuration, tasks/s",
    r"Celery publish-to-start, no-op, idle worker: stock, p50",
    r"100 ops per intake commit",
    r"sweeper pass, 1,200 operations",
    r"reconciler pass, 1,200 operations",
    r"simulator alone, requests/s",
]


def rows(stdout: str) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, met) of every row of the table (not its section lines)."""
    lines = stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+  -+  -+  ---", line))
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    found = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in spans[:3]] + [line[spans[3][0] :].strip()]
        if cells[1]:
            found.append((line[: spans[0][1]].rstrip(), cells[1], cells[2], cells[3]))
    return found


@pytest.mark.timeout(600)
def test_the_pipeline_benchmark_prints_every_figure_beside_its_target(
    pg_server: str, redis_url: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--pg", pg_server,
         "--redis", redis_url, *TINY],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp_path,
        check=False,
    )  # fmt: skip
    said = f"--- stdout\n{done.stdout[-8000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, said

    table = rows(done.stdout)
    with_targets = [(f, t) for f, _, t, met in table if met]
    assert len(with_targets) == len(TARGETS), said
    for (figure, target), (want_figure, want_target) in zip(with_targets, TARGETS, strict=True):
        assert re.fullmatch(want_figure, figure), (figure, said)
        assert re.match(want_target, target), (figure, target, said)
    assert all(met in ("yes", "NO") for _, _, _, met in table if met), said
    for want in REFERENCES:
        assert any(re.fullmatch(want, f) and t == "reference" for f, _, t, _ in table), (want, said)
    assert all(re.match(r"[\d.]+( ms)?$", measured) for _, measured, _, _ in table), said

    succeeded = re.search(r"^operations: (\d+) of (\d+) succeeded", done.stdout, re.MULTILINE)
    assert succeeded, said
    assert succeeded[1] == succeeded[2], said

    # Every system of the live and open-loop phases was judged, and judged correct.
    judged = re.findall(r"^(live|open loop 50/s), ([^:]+):.*judged: (.*)$", done.stdout, re.M)
    systems = {(phase, system) for phase, system, _ in judged}
    assert systems == {
        ("live", "Settled"), ("live", "plain Celery safe"),
        ("open loop 50/s", "Settled"), ("open loop 50/s", "plain Celery safe"),
    }, said  # fmt: skip
    assert all(verdict.endswith(": correct") for _, _, verdict in judged), said
    assert re.search(r"^live, stock Celery no-op: \d+ reached", done.stdout, re.M), said
