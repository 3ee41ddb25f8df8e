"""The serving path, what a request and its rounds run through: the front doors (Generation and Admin over
gRPC, the OpenAI HTTP API), the clients of the draft and target services and their round streams, the replica
pools a round routes over and failover between them. It imports only `orchestrator.decoding` below it."""
