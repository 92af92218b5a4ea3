"""Mutation testing of the safety-critical modules: ``python -m tests.mutation``."""
