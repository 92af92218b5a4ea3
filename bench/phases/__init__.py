"""The phases of ``bench/pipeline.py``, one module each.

``common`` holds the services a run starts (a throwaway database, the simulator, workers) and
the helpers every phase uses; ``intake`` the producers (in this process, or P processes
committing concurrently) and the completion counter; ``noop`` the no-op Celery references
(drain and publish-to-start, stock Celery and the product's configuration); ``drain`` the
drained backlog (end-to-end maximum rate) with the worker-side commits per operation; ``live``
live traffic and open-loop latency, CPU and write transactions for Settled and its peers
(``bench/peers``), each judged correct; ``latency`` commit-to-receipt latency (loaded, and one
operation alone); ``scan`` the sweeper's and the reconciler's pass over a small and a large
table; ``reference`` the simulator alone and a raw-SQL lifecycle.

Nothing in the product imports ``bench``.
"""
