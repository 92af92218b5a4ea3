"""An explicit-state model checker of Settled's protocol (``python -m tests.model``).

``engine`` explores a ``Model``'s reachable states breadth first (so every counterexample is a
shortest one), checks every invariant in every state, checks that from every reachable state a
settled state can still be reached (the liveness property under fair scheduling), and prints a
violation as a readable trace. The models (``tests/model/*.py``) call Settled's real pure
decisions; only storage, network and time are modelled. ``docs/model.md`` describes them.
"""
