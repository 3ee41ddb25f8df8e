"""Control: what keeps the serving path's replicas there and builds the orchestrator over them: the local
supervisor and the Ray controller, launch, scaling, rollouts, attached endpoints. Imports the serving path,
never the tools (`bench`, `distill`) or the command line."""
