"""``python manage.py settled_migrate [--database ALIAS]``: Settled's migrations on Django's
database, what ``settled db upgrade`` does with ``SETTLED_DATABASE_URL`` set from it."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.db import upgrade
from outbox.errors import SettledError
from outbox.settings import masked
from settled.contrib.django.database import settled_database_url


class Command(BaseCommand):
    help = (
        "Apply Settled's migrations (its own tables: operations, runs, ...; not Django "
        "models) to the database of DATABASES[--database]."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default", help="the DATABASES alias")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            url = settled_database_url(options["database"])
            before, after = upgrade(url)
        except SettledError as exc:  # a refused database: one line, no traceback
            raise CommandError(exc.message) from exc
        at = ", ".join(sorted(after)) or "nothing"
        if before == after:
            self.stdout.write(f"{masked(url)} already at {at}")
        else:
            was = ", ".join(sorted(before)) or "nothing"
            self.stdout.write(f"migrated {masked(url)} from {was} to {at}")
