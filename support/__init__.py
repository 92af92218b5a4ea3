"""Settled's support desk: staff accounts and sign-in, finding and reading operations, the
manual review queue and its resolutions, and approving what agents proposed.

It may import ``outbox`` and ``reconciler``; neither imports it."""
