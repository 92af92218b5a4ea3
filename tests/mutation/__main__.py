"""``python -m tests.mutation``: mutation testing of the safety-critical modules.

Without arguments: the fixed CI sample (``SAMPLE_PER_MODULE`` mutants of each module, drawn by
``SEED``), exit status 1 if one survives. ``--all``: every mutant (``--module`` to restrict);
``--list``: name the mutants without running them; ``--results FILE``: write every result as
JSON lines, for the report (docs/mutation.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tests.mutation.equivalent import EQUIVALENT
from tests.mutation.operators import Mutant, mutants_of
from tests.mutation.runner import ROOT, Result, run_all
from tests.mutation.targets import TARGETS

SEED = "settled-44"
SAMPLE_PER_MODULE = 3


def every_mutant(modules: Iterable[str]) -> list[Mutant]:
    found: list[Mutant] = []
    for module in modules:
        found.extend(mutants_of(module, (ROOT / module).read_text()))
    return found


def _rank(mutant: Mutant, seed: str) -> str:
    # by a hash of the name: a mutant added elsewhere does not reshuffle the others
    return hashlib.sha256(f"{seed}:{mutant.id}".encode()).hexdigest()


def sample(mutants: Sequence[Mutant], per_module: int, seed: str = SEED) -> list[Mutant]:
    """The fixed sample: the ``per_module`` lowest-ranked non-equivalent mutants per module."""
    chosen: list[Mutant] = []
    for target in TARGETS:
        own = [m for m in mutants if m.module == target.module and m.id not in EQUIVALENT]
        chosen.extend(sorted(own, key=lambda m: _rank(m, seed))[:per_module])
    return chosen


def run(
    mutants: Sequence[Mutant], jobs: int, timeout: float, *, model: bool, out: Path | None
) -> list[Result]:
    """Run them, printing each result as it comes (and appending it to ``out``, JSON lines)."""
    results: list[Result] = []
    for result in run_all(mutants, jobs, timeout, model=model):
        mark = "SURVIVED" if result.survived else result.status
        mutant = result.mutant
        print(
            f"{mark:>8} {result.seconds:6.1f} s  {mutant.id}  (line {mutant.line}: "
            f"{mutant.change})",
            flush=True,
        )
        if out is not None:
            line = {
                "id": mutant.id,
                "line": mutant.line,
                "change": mutant.change,
                "status": result.status,
                "seconds": round(result.seconds, 1),
                "detail": result.detail,
            }
            with out.open("a") as file:
                file.write(json.dumps(line) + "\n")
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__)
    parser.add_argument("--all", action="store_true", help="every mutant, not the CI sample")
    parser.add_argument("--module", action="append", help="only this module (repeatable)")
    parser.add_argument("--id", action="append", help="only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="name the mutants, run nothing")
    parser.add_argument("--per-module", type=int, default=SAMPLE_PER_MODULE)
    parser.add_argument("--seed", default=SEED)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per mutant")
    parser.add_argument(
        "--no-model", action="store_true", help="tests only, no model run for their survivors"
    )
    parser.add_argument("--results", type=Path, help="write every result here (JSON lines)")
    args = parser.parse_args(argv)
    modules = args.module or [target.module for target in TARGETS]
    mutants = every_mutant(modules)
    if args.id:
        mutants = [m for m in mutants if m.id in set(args.id)]
    elif not args.all:
        mutants = sample(mutants, args.per_module, args.seed)
    if args.list:
        for mutant in mutants:
            print(f"{mutant.id}  (line {mutant.line}: {mutant.change})")
        return 0
    started = time.monotonic()
    results = run(mutants, args.jobs, args.timeout, model=not args.no_model, out=args.results)
    elapsed = time.monotonic() - started
    survivors = [r for r in results if r.survived and r.mutant.id not in EQUIVALENT]
    equivalent = [r for r in results if r.survived and r.mutant.id in EQUIVALENT]
    print(
        f"mutation: {len(results)} mutants, {len(results) - len(survivors) - len(equivalent)} "
        f"killed, {len(equivalent)} equivalent, {len(survivors)} survived, in {elapsed:.1f} s"
    )
    for r in survivors:
        print(f"SURVIVED {r.mutant.id} (line {r.mutant.line}: {r.mutant.change})")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
