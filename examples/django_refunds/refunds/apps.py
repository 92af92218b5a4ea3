from __future__ import annotations

from django.apps import AppConfig


class RefundsConfig(AppConfig):
    """The support tool's refund requests."""

    name = "refunds"
