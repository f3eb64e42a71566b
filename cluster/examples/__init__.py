"""Runnable examples of the rollout client (run them with `python -m raylane.examples.NAME`)."""
