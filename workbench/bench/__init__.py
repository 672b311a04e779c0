"""Benchmarks: workloads, EAGLE-3 vs baseline, peers (transformers), concurrency sweeps."""
