"""Settled's outbox: operation intents written in the caller's transaction."""
