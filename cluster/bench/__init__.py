"""`raylane bench`: throughput, serve, spec and weights, each a table with a reference measured
in the same run. The developers' benchmarks live in benchmarks/ (not installed)."""
