"""Mutants the fast selections cannot kill because they change nothing the selections can
observe about safety, each with the reason. A mutant listed here is still run by ``--all``
(its result is reported), but its survival does not fail the run, and the CI sample never
draws it.

Keep the reasons checkable: a reviewer should be able to read the line and agree.
"""

from __future__ import annotations

EQUIVALENT: dict[str, str] = {
    "workers/sending.py::SendsBatches._send_and_record::const#5": (
        "`first = True` -> False: `first` only arms the test failpoint `after_send` (a no-op "
        "unless a test arms it) and lets the first gather of a batch linger as long as the "
        "sends took (throughput). No outcome, fence or deadline reads it. The crash-after-send "
        "tests that arm the failpoint run real Celery workers (tests/integration/"
        "test_celery_worker.py), outside the fast selection."
    ),
}
