"""Server plumbing of every process: the gRPC server and its error mapping, security, telemetry, metrics,
drain, connection limits, and a model service's start-up (`service`, the one module here that loads the
engine)."""
