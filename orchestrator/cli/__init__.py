"""The `specmesh` command and its settings (flags, the --config file, the client commands): the top tier,
which may import every other orchestrator package."""
