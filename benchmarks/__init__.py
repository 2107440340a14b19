"""Scripts that measure speed and memory and print tables (not tests), each run from the
repository root as `python -m benchmarks.<name>`."""
