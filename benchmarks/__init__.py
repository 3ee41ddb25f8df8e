"""Benchmarks a user or operator runs (`python -m benchmarks.NAME` from the repository root), and the
emulation, link and tiny-model tools they share with the tests."""
