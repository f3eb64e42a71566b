"""Helpers the tests share: the session's Ray cluster (ray_cluster.py)."""
