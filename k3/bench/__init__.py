"""Benchmarks (`k3 bench ...`): ratios measured side by side in one run, never timed tests. The timing
helpers they use, shared with `k3 lab`, are in `k3.bench.timing`."""
