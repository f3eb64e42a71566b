"""The developers' benchmarks: not installed with raylane, run from a checkout's root as
`python -m benchmarks NAME ...` (README.md). They may import tests/support's fakes."""
