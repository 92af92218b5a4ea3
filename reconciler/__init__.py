"""Settled's reconciler: the pure reconcile decision and the pass on celery beat that asks the
downstream about every operation whose outcome is unknown."""
