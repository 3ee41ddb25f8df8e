"""The client-facing servers: Generation and Admin over gRPC, the OpenAI HTTP API, the specmesh CLI."""
