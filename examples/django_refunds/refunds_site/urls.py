"""POST /refunds files a refund; GET /refunds/<key> says where it stands."""

from __future__ import annotations

from django.urls import path
from refunds import views

urlpatterns = [
    path("refunds", views.file_refund),
    path("refunds/<str:request_key>", views.refund_status),
]
