"""Settled workers: the executor and its verdicts, the HTTP gateway adapter, the relay and the
sweeper. The Celery wiring that runs them is in ``settled``."""
