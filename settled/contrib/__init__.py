"""Settled inside the frameworks apps are built with: ``settled.contrib.django``."""
