"""Benchmarks run by ``hybridcache bench <scenario>``."""
