"""specmesh: speculative decoding with the draft and the target as separate gRPC services.

This package holds what both services and the orchestrator share: the generated
wire contract (`specmesh.v1`), model loading, the per-session KV-cache engine,
sampling math and gRPC server plumbing.
"""

__version__ = "0.1.0"
