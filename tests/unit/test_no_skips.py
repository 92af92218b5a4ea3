"""CI runs every test: under ``SETTLED_TEST_NO_SKIPS=1`` a skip is a failure."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INNER = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("no such tool here")

@pytest.mark.skipif(True, reason="not on this system")
def test_marked():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False
"""


@pytest.mark.parametrize("flag", ["1", "", "0"])
def test_a_skip_fails_only_when_every_test_must_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    monkeypatch.setenv("SETTLED_TEST_NO_SKIPS", flag)
    pytester.makepyfile(INNER)
    result = pytester.runpytest_inprocess("-p", "tests.support.no_skips", "-p", "no:cacheprovider")
    if flag == "1":
        # a skip in the test fails it; a skip mark (taken at set-up) is an error of it
        result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)
        result.stdout.fnmatch_lines(["*skipped with SETTLED_TEST_NO_SKIPS=1*no such tool here*"])
    else:
        result.assert_outcomes(passed=1, skipped=2, xfailed=1)
