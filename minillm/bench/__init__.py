"""Benchmarks: the workloads of BENCHMARKS.md, vLLM's metrics, the peers, and the roofline."""
