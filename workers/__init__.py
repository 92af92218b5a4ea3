"""Settled workers: the downstream gateway, the executor, the relay, the sweeper, Celery wiring."""
