"""The example project's settings: the refunds app and Settled's, one SQLite file.

Settled reads its own settings from the environment (``SETTLED_*``: the broker, the keys, the
downstream); its database is Django's ``DATABASES["default"]``
(``python manage.py settled_database_url``).
"""

from __future__ import annotations

import os
from pathlib import Path

# An example's key, for a process on 127.0.0.1: a real project reads its own from the
# environment.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-refunds-example-only")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "settled.contrib.django",  # settled_migrate, settled_database_url
    "refunds",
]
MIDDLEWARE: list[str] = []  # a JSON API for the support tool, no sessions or cookies
ROOT_URLCONF = "refunds_site.urls"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        # Relative to the folder the commands run in (the README's: the repository's root).
        "NAME": Path(os.environ.get("REFUNDS_SQLITE", "var/django_refunds.sqlite3")).resolve(),
        "OPTIONS": {
            # Take SQLite's write lock when atomic() begins, and wait for it: the worker
            # writes to the same file (as Settled's own connections do).
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        },
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
