"""Prompt sets and JSONL prompt files, shared by `specmesh bench` and `specmesh distill`."""
