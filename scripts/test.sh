#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, tests. Installs into ./.venv first.
# PostgreSQL is used where it answers (SETTLED_TEST_DATABASE_URL, else 127.0.0.1), else the tests
# start a throwaway server; Redis is always a throwaway server of each test's own.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
# The documentation site, strictly: a broken link, a missing anchor or a page left out of the
# nav fails the build (mkdocs.yml, "validation"). Built into a folder of its own, then removed.
# Not --quiet: it hides the warnings from --strict too, and the build then passes with them.
echo "== mkdocs build --strict"
site_dir=$(mktemp -d)
.venv/bin/mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
# Hypothesis draws the same examples every run here (tests/conftest.py, profile "ci"); a bare
# pytest explores.
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
if [ "$#" -gt 0 ]; then
  .venv/bin/pytest "$@"  # a selection: no coverage floor
  exit
fi
# The model checker (python -m tests.model: the CI configurations, exhaustive, and every broken
# variant) on one core, and, beside the unit tests on the other, the mutation suite
# (python -m tests.mutation, docs/mutation.md): a fixed sample of mutants of the safety-critical
# modules, each run against its module's tests in a private copy of the tree; a mutant that
# survives fails the build. SETTLED_TEST_MUTATION=all runs every mutant instead. The unit tests
# and the sample together take about as long as the model checker alone; their figures are
# printed after the unit tests'.
# A failure on the way stops the two background runs too.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
model_log=$(mktemp)
.venv/bin/python -m tests.model --jobs 2 >"$model_log" 2>&1 &
model_pid=$!
mutation_log=$(mktemp)
if [ "${SETTLED_TEST_MUTATION:-sample}" = all ]; then
  .venv/bin/python -m tests.mutation --all >"$mutation_log" 2>&1 &
else
  .venv/bin/python -m tests.mutation >"$mutation_log" 2>&1 &
fi
mutation_pid=$!
echo "== pytest: unit tests, with the coverage floor on the pure core"
.venv/bin/pytest tests/unit --cov --cov-report=term
# Print a background run's output, and stop with its status if it failed.
finish() {
  local pid=$1 log=$2 what=$3 status=0
  wait "$pid" || status=$?
  cat "$log"
  rm -f "$log"
  if [ "$status" -ne 0 ]; then
    echo "$what failed (exit status $status)" >&2
    exit "$status"
  fi
}
echo "== the model checker: python -m tests.model"
finish "$model_pid" "$model_log" "the model checker"
echo "== the mutation sample: python -m tests.mutation"
finish "$mutation_pid" "$mutation_log" "the mutation suite"
echo "== pytest: the model checker, integration and end-to-end (PostgreSQL, Redis, Celery workers, the simulator)"
# Three test processes per two cores: most of these tests wait on other processes (workers,
# servers, the simulator), so one per core left them part idle (load average about 1.5).
# Work stealing: a process that runs out takes tests from another's queue, so a few long
# tests (a Patroni failover, a 30 s outage) at the end of one queue do not leave the others
# idle while they finish. The tests that spawn processes come first (tests/conftest.py), the
# end-to-end ones (the benchmark, the soak) first of all.
.venv/bin/pytest tests/e2e tests/integration tests/model -n "$(( ($(nproc) * 3 + 1) / 2 ))" \
  --dist worksteal --durations=40
