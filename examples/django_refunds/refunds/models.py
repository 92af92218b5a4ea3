"""The app's own table: one row per refund a support agent filed (a Django model, migrated by
``manage.py migrate``; Settled's tables are not models, ``settled_migrate`` makes them)."""

from __future__ import annotations

from django.db import models


class RefundRequest(models.Model):
    """A refund a support agent filed, and the Settled operation it created."""

    tenant = models.CharField(max_length=64)
    request_key = models.CharField(max_length=64)  # the client's Idempotency-Key
    op_id = models.CharField(max_length=80)  # minted by new_op_id(), kept for every replay
    order_id = models.CharField(max_length=64)
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    payee = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [  # noqa: RUF012 - Django's Meta
            models.UniqueConstraint(fields=["tenant", "request_key"], name="uq_refund_request_key")
        ]
