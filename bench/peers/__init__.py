"""The systems the live-traffic and open-loop phases drive, beside Settled: each has a ``Feed``
(one producer process's side: commit one refund, then hand it to the system) and, where it has
one, a worker.

``feed`` is the producer process itself (standard library only, so that it also runs in the
peers' own environment); ``feeds`` holds the Settled and the stock Celery no-op feeds;
``celery_safe`` the plain Celery "safe" peer; ``external`` installs and drives Procrastinate
and DBOS in an environment of their own (``procrastinate_peer``, ``dbos_peer`` run there).
"""
