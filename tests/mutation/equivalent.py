"""Mutants that no test can kill because they do not change what the code does, each with the
reason. A mutant listed here is still run by ``--all`` (its result is reported), but its
survival does not fail the run, and the CI sample never draws it.

Keep the reasons checkable: a reviewer should be able to read the line and agree.
"""

from __future__ import annotations

EQUIVALENT: dict[str, str] = {}
