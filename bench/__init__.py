"""Benchmarks: kernels (bench.kernels), long-context sweeps; results in bench/RESULTS.md."""
