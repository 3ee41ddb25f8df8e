"""`specmesh bench`: load-test a specmesh server (gRPC or HTTP), A/B speculation on vs off, and
compare with transformers' assisted generation; prints tables, writes result.json and PNG plots."""
