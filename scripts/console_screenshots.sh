#!/usr/bin/env bash
# The console screenshots of docs/support.md: run the console's browser test (which photographs each main
# page into test-artifacts/console/), then copy them into docs/console/. Needs /usr/bin/chromium
# and the test database (as the test suite); installs into ./.venv first, as scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
rm -rf test-artifacts/console
SETTLED_TEST_REQUIRE_BROWSER=1 .venv/bin/pytest -q tests/e2e/test_console_browser.py
mkdir -p docs/console
for page in login queue item search find operation overview proposal; do
  cp "test-artifacts/console/$page.png" "docs/console/$page.png"
done
echo "docs/console/: $(ls docs/console | tr '\n' ' ')"
