"""Settled's entry points: the command line, the process wiring (runtime, Celery app, web,
metrics, tracing, supervisor), the demo, and the payment service simulator
(``settled.simulator``, a product of its own that users run in their tests).

This package sits on top: it imports the core (``outbox``), ``workers`` and ``reconciler``;
none of them imports it (ARCHITECTURE.md).
"""
