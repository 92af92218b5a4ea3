"""Settled workers: the executor and its verdicts, the HTTP gateway adapter and the sweeper.
The Celery wiring that runs them is in ``settled``; the relay the app installs is in the core
(``outbox.relay``)."""
