"""The Django example (examples/django_refunds): its README's commands run as a user runs them
(``manage.py migrate``, ``settled_database_url``, ``settled db upgrade``, the simulator,
``settled worker``, ``manage.py runserver``, curl) until the refund succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.readme_run import EXAMPLES, follow_readme


@pytest.mark.slow
def test_the_readme_followed_word_for_word_ends_in_a_refund(tmp_path: Path) -> None:
    """Every command of "Run it", from a checkout's root (``examples/`` there), on free ports
    instead of 8700 and 8080 (``tests.support.readme_run``); the app's database is the file
    Django's settings name, and the worker finds the intent there."""
    app = "python examples/django_refunds/manage.py runserver"
    answer = follow_readme(EXAMPLES / "django_refunds", tmp_path, app=app)
    assert answer["request"]["request_key"] == "7d1e4c2a-refund-1"
    assert '"re_' in json.dumps(answer["operation"])  # the downstream's reference
    assert (tmp_path / "var" / "django_refunds.sqlite3").is_file()
