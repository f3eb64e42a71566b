"""Helpers the tests share: the session's Ray cluster (ray_cluster.py), a throw-away PostgreSQL
(pgtemp.py), and model-free stand-ins: a scripted consolidation LLM (fake_llm.py) and a
`TurnGenerator` (fake_generator.py). Not installed: the benchmarks in benchmarks/ import them
when run from a checkout."""
