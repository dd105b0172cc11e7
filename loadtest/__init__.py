"""The load test and the benchmarks: run each from the repository root as
``python -m loadtest.<name>``."""
