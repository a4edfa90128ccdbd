"""Workload generation, replay, benchmarks and load tests (installed as hstu.scripts)."""
