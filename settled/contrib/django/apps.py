"""The Django app: ``"settled.contrib.django"`` in ``INSTALLED_APPS`` gives the management
commands (``settled_migrate``, ``settled_database_url``). It has no models: Settled's tables are
migrated by Settled's own migrations (``settled_migrate``), not Django's."""

from __future__ import annotations

from django.apps import AppConfig


class SettledConfig(AppConfig):
    """Settled's commands in a Django project."""

    name = "settled.contrib.django"
    label = "settled"
    verbose_name = "Settled"
