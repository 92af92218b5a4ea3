"""``python manage.py settled_database_url [--database ALIAS] [--show-password]``: the URL
Settled's processes use for Django's database, for ``SETTLED_DATABASE_URL``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.errors import SettledError
from outbox.settings import masked
from settled.contrib.django.database import settled_database_url


class Command(BaseCommand):
    help = (
        "Print the SQLAlchemy URL of DATABASES[--database], for SETTLED_DATABASE_URL: "
        'export SETTLED_DATABASE_URL="$(python manage.py settled_database_url '
        '--show-password)". The password is masked unless --show-password.'
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default", help="the DATABASES alias")
        parser.add_argument(
            "--show-password", action="store_true", help="print the password, not ***"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            url = settled_database_url(options["database"])
        except SettledError as exc:  # a refused database: one line, no traceback
            raise CommandError(exc.message) from exc
        self.stdout.write(url if options["show_password"] else masked(url))
