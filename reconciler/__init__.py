"""Settled's reconciler and manual review queue."""
