"""`specmesh serve`: a short command line, every other setting from a YAML config file.

Real parsing throughout: the parser `specmesh` runs, files written to tmp_path, and the options
objects the serve path builds from what was parsed.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from harness import serve_config
from orchestrator.decoding.options import loop_config
from orchestrator.control import ray_cli
from orchestrator.control.attached import parse_endpoints
from orchestrator.control.launch import local_pools_options
from orchestrator.distill.online import fraction, online_distill_options
from orchestrator.cli.main import build_parser, frontend_options, main, metrics_ports_of, serve_pools_options
from orchestrator.control.config_error import ConfigError
from orchestrator.cli.config_file import settings_by_key
from orchestrator.cli.serve_args import serve_settings
from specmesh.server.connections import ConnectionLimits, positive_seconds
from specmesh.loading.cpu_linear import KERNEL_CHOICES
from specmesh.engine.kv_budget import parse_kv_cache_memory
from specmesh.server.security import Security
from specmesh.server.service import add_service_arguments, parse_cpu_list, positive_int

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# One value a setting of each type may take in a file, and what it parses to. A setting whose type
# is not here fails test_a_config_file_sets_every_setting until it gets a sample.
SAMPLES = {
    int: (3, 3),
    float: (0.25, 0.25),
    positive_seconds: (0.25, 0.25),
    positive_int: (7, 7),
    parse_cpu_list: ([0, 2], (0, 2)),
    parse_kv_cache_memory: ("1GiB", parse_kv_cache_memory("1GiB")),
    ray_cli._resources: ({"specmesh_pool": 1}, {"specmesh_pool": 1}),
    fraction: (0.25, 0.25),
    parse_endpoints: (["host-a:50061", "host-b:50061"], ("host-a:50061", "host-b:50061")),
}


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def sample(key: str, action: argparse.Action) -> tuple[object, object]:
    """(the YAML value, the parsed value): never the default, so the file visibly sets it."""
    if action.nargs == 0:
        return (not action.default), (not action.default)
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return choice, choice
    if action.type is None:
        return f"value-of-{key}", f"value-of-{key}"
    if action.type not in SAMPLES:
        pytest.fail(f"setting {key!r}: no sample value for its type {action.type!r}; add one to SAMPLES")
    return SAMPLES[action.type]


def every_setting() -> dict[str, tuple[object, object]]:
    """Every config key of `specmesh serve`, from its one definition, with a sample value."""
    return {key: sample(key, action) for key, action in settings_by_key(serve_settings()).items()}


def test_serve_help_lists_at_most_20_options_in_groups(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = [line.split()[0].rstrip(",") for line in text.splitlines() if re.match(r"^  -", line)]
    assert len(options) <= 20, options
    assert {"--config", "--target", "--num-speculative-tokens", "--api-key", "--kv-cache-memory"} <= set(options)
    for group in ("models:", "network:", "speculation:", "security:", "memory:", "deployment:"):
        assert f"\n{group}\n" in text
    visible = [a for a in serve_parser()._actions if a.help != argparse.SUPPRESS]
    assert len(visible) == len(options)
    assert "--target-dtype" not in text and "--max-restarts" not in text


def test_a_config_file_sets_every_setting(tmp_path):
    settings = every_setting()
    assert len(settings) > 50  # the whole definition, not a handful
    # Half the keys as written in the docs, half with underscores: both spell the same setting.
    written = {(key.replace("-", "_") if i % 2 else key): value for i, (key, (value, _)) in enumerate(settings.items())}
    (tmp_path / "all.yaml").write_text(yaml.safe_dump(written))
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "all.yaml")])
    actions = settings_by_key(serve_settings())
    for key, (_, parsed) in settings.items():
        assert getattr(args, actions[key].dest) == parsed, key
    options_land_where_they_are_used(args)


def options_land_where_they_are_used(args: argparse.Namespace) -> None:
    """The parsed settings reach the options each process runs with."""
    security = Security(api_key="key")
    local = local_pools_options(args, security, metrics_ports_of(args.metrics_port), "token")
    target, draft = local.target.replica.service, local.draft.replica.service
    assert (target.dtype, target.cpus, target.device) == (args.target_dtype, (0, 2), "value-of-device")
    assert (draft.dtype, draft.cpus, draft.device) == (args.draft_dtype, (0, 2), "value-of-draft-device")
    for service in (target, draft):
        assert (service.max_step_tokens, service.prefill_slowdown, service.max_waiting_sessions) == (7, 0.25, 7)
        assert service.kv_cache_memory == parse_kv_cache_memory("1GiB") and service.cpu_linear == args.cpu_linear
        assert (service.trace_exporter, service.trace_sample_ratio, service.shutdown_grace_s) == (
            args.trace_exporter, 0.25, 0.25)
    assert local.draft.replica.greedy_proposals and local.target.replica.disagreement_log == (
        "value-of-disagreement-log", 0.25, True)
    restarts = local.restart_policy
    assert (restarts.max_restarts, restarts.window_s, local.max_replica_failures) == (3, 0.25, 3)
    assert (restarts.crash_loop_backoff_s, restarts.max_crash_loop_backoff_s) == (0.25, 0.25)
    assert (local.target.replicas, local.draft.replicas) == (3, 3)
    online = online_distill_options(args)
    started = argparse.Namespace(**{**vars(args), "target_endpoints": None, "draft_endpoints": None})
    assert serve_pools_options(started, security, metrics_ports_of(args.metrics_port))[0].online_distill == online
    assert online.directory == Path("value-of-online-distill-dir").resolve() and online.distill_args == (
        "value-of-online-distill-args",)
    assert (online.max_bytes, online.tokens, online.interval_s, online.sample, online.cpus, online.gpus) == (
        3, 3, 0.25, 0.25, 0.25, 0.25)
    assert (online.device, online.timeout_s, online.rollback_margin, online.rollback_window) == (
        "value-of-online-distill-device", 0.25, 0.25, 7)
    ray = ray_cli.pools_options(args, security, "token")
    assert ray.namespace == "value-of-ray-namespace"
    for spec in (ray.target, ray.draft):
        assert (spec.num_cpus, spec.num_gpus, spec.resources) == (0.25, 0.25, {"specmesh_pool": 1})
        assert (spec.load_per_replica, spec.drain_grace_s, spec.replica.service.max_step_tokens) == (0.25, 0.25, 7)
    loop = loop_config(args)
    assert (loop.num_speculative_tokens, loop.draft_timeout_s, loop.extra_branches) == (3, 0.25, 3)
    assert (loop.pipeline, loop.adaptive_k, loop.prompt_lookup) == (args.pipeline, False, False)
    frontend = frontend_options(args, security, 3)
    assert (frontend.host, frontend.http_port, frontend.max_request_bytes, frontend.api_key) == (
        "value-of-host", 3, 7, "key")
    assert frontend.connection_limits == ConnectionLimits(3, 3, 0.25, 0.25, 0.25, 3, 0.25)


def test_the_command_line_wins_over_the_file(tmp_path):
    config = serve_config(tmp_path, port=1234, target_dtype="bfloat16", pipeline="on", max_restarts=9)
    args = build_parser().parse_args(["serve", *config, "--port", "99"])
    assert (args.port, args.target_dtype, args.pipeline, args.max_restarts) == (99, "bfloat16", "on", 9)
    assert args.http_port == 8000 and args.draft_dtype == "auto"  # neither given: the defaults
    flipped = build_parser().parse_args(["serve", "--port", "99", *config])
    assert flipped.port == 99  # wherever --config stands


def test_yaml_booleans_read_as_on_and_off(tmp_path):
    """YAML 1.1 reads an unquoted `on` as true: the on/off settings take it as the choice."""
    (tmp_path / "c.yaml").write_text("pipeline: on\nprompt_lookup: off\ntls: true\n")
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "c.yaml")])
    assert (args.pipeline, args.prompt_lookup, args.tls) == ("on", "off", True)


@pytest.mark.parametrize("text, named", [
    ("pipline: on\n", "'pipline' (did you mean 'pipeline'?)"),
    ("max-step-tokens: many\n", "'max-step-tokens'"),
    ("max_step_tokens: 0\n", "'max_step_tokens'"),
    ("speculation-policy: sometimes\n", "'speculation-policy': 'sometimes' is not one of adaptive, fixed"),
    ("greedy-draft: maybe\n", "'greedy-draft': expected true or false"),
    ("target-cpus: {a: 1}\n", "'target-cpus'"),
    ("host: [a, b]\n", "'host': expected one value, not a list"),
    ("config: other.yaml\n", "'config'"),
    ("- target-dtype\n", "expected a mapping"),
])
def test_a_bad_key_or_value_is_an_error_naming_it(tmp_path, capsys, text, named):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(named)):
        build_parser().parse_args(["serve", "--config", str(path)])
    assert main(["serve", "--config", str(path)]) == 2  # before anything starts
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(path) in error and named in error


def test_a_file_only_setting_on_the_command_line_says_where_it_goes(capsys):
    assert main(["serve", "--target-dtype", "bfloat16"]) == 2
    assert "'target-dtype: VALUE' in the --config FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:  # the old alias is gone: argparse's own refusal
        main(["serve", "--sessions-per-replica", "3"])
    assert done.value.code == 2 and "unrecognized arguments: --sessions-per-replica" in capsys.readouterr().err


def test_serve_and_the_service_cli_share_the_batching_settings():
    service = argparse.ArgumentParser()
    add_service_arguments(service, default_model="m")
    serve, alone = settings_by_key(serve_settings()), settings_by_key(service)
    for key in ("max-step-tokens", "prefill-slowdown", "kv-cache-memory", "max-waiting-sessions", "cpu-linear"):
        assert (serve[key].type, serve[key].default) == (alone[key].type, alone[key].default), key
    assert serve["cpu-linear"].choices == KERNEL_CHOICES


def test_the_configuration_doc_lists_every_key():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9-]+)`", doc, re.MULTILINE))
    assert documented == set(every_setting()), (set(every_setting()) - documented, documented - set(every_setting()))
