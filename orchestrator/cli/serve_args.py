"""`specmesh serve`'s settings: each defined once, a few of them on the command line.

`serve_settings()` is the one definition of every setting (flag name, type, choices, default,
help). `specmesh serve --help` shows the options in USER_OPTIONS, which are what a user sets:
models, ports, k, security, KV memory, the backend. Every other setting (precisions, CPU pinning,
pipelining, batching, tracing, pool sizes, supervision, ...) is a key of the `--config FILE`
(orchestrator.cli.config_file), checked by the same definition; docs/configuration.md
lists them all.
"""

from __future__ import annotations

import argparse

from orchestrator.control import ray_cli as pools_cli
from orchestrator.control.attached import add_attached_arguments
from orchestrator.control.launch import TARGET_HELP, add_model_arguments, add_supervision_arguments
from orchestrator.distill.online import add_online_distill_arguments
from orchestrator.cli.config_file import ConfigurableParser
from specmesh.server.connections import add_connection_arguments
from specmesh.server.drain import add_shutdown_arguments
from specmesh.server.security import add_api_key_arguments, add_client_tls_arguments, add_server_tls_arguments
from specmesh.server.service import (add_batching_arguments, add_kv_cache_arguments, add_request_limit_argument,
                                     add_telemetry_arguments)
from target_service.disagreements import add_disagreement_log_arguments

# The command line's options by help group, named by dest; the rest only from --config FILE.
USER_OPTIONS: dict[str, tuple[str, ...]] = {
    "models": ("target", "draft", "device", "draft_device"),
    "network": ("host", "port", "http_port", "metrics_port"),
    "speculation": ("num_speculative_tokens", "speculation_policy"),
    "security": ("api_key", "api_key_file", "tls_cert", "tls_key", "tls_ca"),
    "memory": ("kv_cache_memory",),
    "deployment": ("backend", "address"),
}
CONFIG_HELP = ("YAML file of settings: every option below and every other setting (precisions, CPU pinning, "
               "pipelining, batching, tracing, pool sizes, supervision, ...), named by its long flag without "
               "the dashes ('target-dtype: bfloat16'); the command line wins. docs/configuration.md lists them")


def serve_settings() -> argparse.ArgumentParser:
    """Every setting of `specmesh serve`, as flags: what its command line and its config file may set."""
    settings = argparse.ArgumentParser(prog="specmesh serve", add_help=False)
    # The orchestrator always loads the target's tokenizer: with attached targets, from this spec.
    add_model_arguments(settings, TARGET_HELP + "; with target-endpoints (config file), the model whose "
                                                "tokenizer the orchestrator loads, checked against the attached "
                                                "targets' vocabulary")
    settings.add_argument("--host", default="127.0.0.1", help="address every service binds")
    settings.add_argument("--port", type=int, default=50051, metavar="PORT", help="client-facing gRPC port")
    settings.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                          help="OpenAI-compatible HTTP API port (0 = any free port, -1 = off)")
    add_request_limit_argument(settings)
    add_connection_arguments(settings)  # the client-facing ports' bounds
    add_kv_cache_arguments(settings)  # each model service's own budget (a fraction: of its device)
    add_batching_arguments(settings)  # each model service's, as `python -m draft_service|target_service` sets them
    settings.add_argument("--greedy-draft", action="store_true",
                          help="the draft proposes its argmax tokens (point masses) even when sampling")
    add_telemetry_arguments(settings, default_metrics_port=9400)
    add_disagreement_log_arguments(settings)
    add_server_tls_arguments(settings)
    add_client_tls_arguments(settings)
    add_api_key_arguments(settings, serving=True)
    add_shutdown_arguments(settings)
    pools_cli.add_serve_arguments(settings)
    add_attached_arguments(settings)
    add_supervision_arguments(settings)
    add_online_distill_arguments(settings)
    return settings


def add_serve_parser(commands) -> ConfigurableParser:
    """`specmesh serve`: --config FILE and the USER_OPTIONS, grouped; `commands` makes ConfigurableParsers."""
    settings = serve_settings()
    serve = commands.add_parser(
        "serve", help="start the draft, target and orchestrator services",
        description="Start the draft, target and orchestrator services. Every other setting is a key of the "
                    "--config FILE; docs/configuration.md lists them.")
    serve.accept_config_file(settings, CONFIG_HELP)
    actions = {action.dest: action for action in settings._actions}  # argparse has no public list
    for title, dests in USER_OPTIONS.items():
        group = serve.add_argument_group(title)
        for dest in dests:
            # The setting's own action, as argparse's `parents=` shares them: one definition for both.
            group._add_action(actions[dest])
    return serve
