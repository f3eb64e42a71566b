"""Runnable examples of the rollout client (run them with `python -m cluster.examples.NAME`)."""
