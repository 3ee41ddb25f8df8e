"""deploy/grafana/specmesh-dashboard.json: a well-formed Grafana dashboard JSON model whose every
query names series the services really export.

The exported names come from a real scrape: a target, a draft and an orchestrator started the way a
deployment starts them (specmesh.server.service.start_model_service serves each service's /metrics; the
orchestrator's registry is served the same way), one request through them so the labelled series
exist, then the three /metrics texts parsed with prometheus_client's own parser. A renamed metric, a
changed suffix or a label a panel filters on that the series lack fails here instead of showing an
empty panel in Grafana.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import specmesh.server.service
from benchmarks.tiny_models import TINY_PROMPTS
from harness import WORK_TIMEOUT_S, eventually, load, make_engine
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.clients import open_channel
from orchestrator.control.replicas import create_model_server
from orchestrator.control.build import create_server as create_orchestrator_server
from orchestrator.cli.stats_view import fetch_metrics
from specmesh.server.metrics import OrchestratorMetrics, serve_metrics
from specmesh.server.service import ReplicaConfig, ServiceOptions, start_model_service
from specmesh.v1 import generation_pb2, generation_pb2_grpc

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "specmesh-dashboard.json"
SCHEMA_VERSION = 39  # Grafana 10.4's; later versions migrate it forward on load (deploy/grafana/README.md)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus attaches to every scraped series (the target's), which no process exports itself.
TARGET_LABELS = {"job", "instance"}
# Series names each metric type exposes, beyond the samples a scrape happened to carry: a labelled
# metric nothing has counted yet is exported as its HELP and TYPE lines alone.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
            "info": ("_info",), "stateset": ("",), "gauge": ("",), "unknown": ("",)}

# ---- PromQL: the series names and label names an expression uses

IDENTIFIER = r"[A-Za-z_:][A-Za-z0-9_:]*"
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "atan2"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(series name, label names it matches on) for every series selector in `expr`."""
    expr = _strip_strings(expr)
    found = []
    for match in re.finditer(rf"({IDENTIFIER})?\s*\{{([^{{}}]*)\}}", expr):
        labels = set(re.findall(rf"({IDENTIFIER})\s*(?:=~|!~|!=|=)", match.group(2)))
        found.append((match.group(1) or "", labels))
    return found


def metric_names(expr: str) -> set[str]:
    """The series names `expr` reads: identifiers that are no function, operator keyword, label
    (matchers, `by (...)` and the like), string, number, duration or Grafana variable."""
    expr = _strip_strings(expr)
    named = {name for name, _ in selectors(expr) if name}
    expr = re.sub(r"\{[^{}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\[\]]*\]", " ", expr)  # ranges and subqueries: [5m], [$__rate_interval]
    expr = GROUPING.sub(" ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables outside strings
    expr = re.sub(r"(?<![A-Za-z0-9_:])(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:])", " ", expr)  # offset 1h30m
    expr = re.sub(r"(?<![A-Za-z0-9_:])(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)", " ", expr)
    bare = {match.group(1) for match in re.finditer(rf"({IDENTIFIER})(\s*\()?", expr)
            if not match.group(2) and match.group(1).lower() not in KEYWORDS}
    return named | bare


def grouping_labels(expr: str) -> set[str]:
    """Label names of `by`, `without`, `on` and `ignoring` clauses (not group_left's copies)."""
    expr = _strip_strings(expr)
    return {label.strip() for keyword, labels in GROUPING.findall(expr) if keyword not in ("group_left", "group_right")
            for label in labels.split(",") if label.strip()}


def variable_query(query: str) -> str:
    """The PromQL inside a Prometheus templating query (label_values(EXPR, label), query_result(EXPR), ...)."""
    found = re.fullmatch(r"\s*label_values\((.*?)(?:,\s*(\w+))?\)\s*", query) or \
        re.fullmatch(r"\s*(?:query_result|metrics)\((.*)\)\s*", query)
    return found.group(1) if found else query


# ---- The exported side

def exported_series(texts: list[str]) -> dict[str, set[str] | None]:
    """Series name -> label names of its samples, over several /metrics texts (None: exported, no samples yet)."""
    series: dict[str, set[str] | None] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for suffix in SUFFIXES.get(family.type, ("",)):
                series.setdefault(family.name + suffix, None)
            for sample in family.samples:
                series[sample.name] = (series.get(sample.name) or set()) | set(sample.labels)
    return series


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = [(f"panel {panel.get('id')} {panel.get('title')!r} {target.get('refId')}", target.get("expr", ""))
             for panel in panels_of(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query or ""
            found.append((f"variable {variable.get('name')}", variable_query(query)))
    return found


def problems(dashboard: dict, exported: dict[str, set[str] | None]) -> list[str]:
    """What in `dashboard`'s queries the scraped services do not export: unknown series, and label
    names the series (where samples show their labels) do not carry."""
    found = []
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        if not names:
            found.append(f"{where}: no series in {expr!r}")
        for name in sorted(names - set(exported)):
            found.append(f"{where}: {name} is not exported")
        known = {name: exported[name] | ({"le"} if name.endswith("_bucket") else set())
                 for name in names if exported.get(name) is not None}
        for name, labels in selectors(expr):
            if name in known and labels - known[name] - TARGET_LABELS:
                found.append(f"{where}: {name} has no label {sorted(labels - known[name])}")
        if known and len(known) == len(names):  # every series' labels are known
            carried = set().union(*known.values()) | TARGET_LABELS
            for label in sorted(grouping_labels(expr) - carried):
                found.append(f"{where}: no series in {expr!r} has the label {label!r}")
    return found


def panels_of(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    return [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# ---- The JSON model

def test_dashboard_is_a_grafana_json_model(dashboard):
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    assert dashboard["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert isinstance(dashboard["refresh"], str) and dashboard["time"]["from"]  # schema 40 wants a string
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = panels_of(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        covered = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                   for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & covered, f"panel {panel['id']} overlaps another"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["datasource"] == DATASOURCE, panel["id"]
        targets = panel["targets"]
        assert targets and all(t["expr"].strip() and t["datasource"] == DATASOURCE for t in targets), panel["id"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["id"]
        for target in targets:
            expr = _strip_strings(target["expr"])
            assert all(expr.count(a) == expr.count(b) for a, b in ("()", "[]", "{}")), target["expr"]


@pytest.mark.unit
def test_grafanas_own_dashboard_model_reads_it_back(dashboard):
    """Grafana's Foundation SDK (its dashboard kind, generated from Grafana's schemas) reads the model: every
    panel as a panel or a row, and writing it back keeps each panel's type, title and queries."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as grafana

    plugins.register_default_plugins()
    read = grafana.Dashboard.from_json(copy.deepcopy(dashboard))
    assert read.schema_version == SCHEMA_VERSION and read.uid == dashboard["uid"]
    flat = [p for top in read.panels for p in (top, *(getattr(top, "panels", None) or []))]
    assert all(isinstance(panel, (grafana.Panel, grafana.RowPanel)) for panel in flat)
    assert len(flat) == len(panels_of(dashboard))

    def essentials(model: dict) -> list[tuple]:
        return [(p["type"], p["title"], tuple(t["expr"] for t in p.get("targets", []))) for p in panels_of(model)]
    assert essentials(json.loads(json.dumps(read, cls=JSONEncoder))) == essentials(dashboard)


# ---- The extractor, on its own (so the check below can fail)

def test_metric_names_keep_series_and_drop_the_rest():
    expr = ('histogram_quantile(0.9, sum by (part, le) (rate(specmesh_round_time_seconds_bucket'
            '{model=~"$model", prompt_class=~"a|b"}[$__rate_interval]))) / ignoring(part) group_left '
            'scalar(sum(rate(x_total[5m] offset 1h))) + 1e-3 * time() - on(instance) up == bool 1')
    assert metric_names(expr) == {"specmesh_round_time_seconds_bucket", "x_total", "up"}
    assert grouping_labels(expr) == {"part", "le", "instance"}
    assert selectors(expr) == [("specmesh_round_time_seconds_bucket", {"model", "prompt_class"})]
    assert variable_query('label_values(specmesh_requests_total{model=~"$model"}, prompt_class)') == \
        'specmesh_requests_total{model=~"$model"}'


def test_problems_flags_what_is_not_exported():
    exported = {"specmesh_requests_total": {"model", "prompt_class", "finish_reason"},
                "specmesh_ttft_seconds_bucket": {"model"}, "specmesh_online_distill_cycles_total": None,
                "specmesh_online_distill_rollbacks_total": set()}
    board = {"panels": [{"id": 1, "title": "t", "targets": [
        {"refId": "A", "expr": "sum(rate(specmesh_made_up_total[5m]))"},
        {"refId": "B", "expr": 'sum by (finish_reason) (rate(specmesh_requests_total{model="m"}[5m]))'},
        {"refId": "C", "expr": 'rate(specmesh_requests_total{colour="red"}[5m])'},
        {"refId": "D", "expr": "histogram_quantile(0.5, sum by (le, model) (rate(specmesh_ttft_seconds_bucket[1m])))"},
        {"refId": "E", "expr": "sum by (shard) (rate(specmesh_requests_total[1m]))"},
        {"refId": "F", "expr": "sum by (outcome) (specmesh_online_distill_cycles_total)"},  # labels unknown: kept
        {"refId": "G", "expr": "vector(1)"},
        {"refId": "H", "expr": "sum by (outcome) (specmesh_online_distill_rollbacks_total)"}]}]}
    assert problems(board, exported) == [
        "panel 1 't' A: specmesh_made_up_total is not exported",
        "panel 1 't' C: specmesh_requests_total has no label ['colour']",
        "panel 1 't' E: no series in 'sum by (shard) (rate(specmesh_requests_total[1m]))' has the label 'shard'",
        "panel 1 't' G: no series in 'vector(1)'",
        "panel 1 't' H: no series in 'sum by (outcome) (specmesh_online_distill_rollbacks_total)' has the label "
        "'outcome'"]


# ---- Against a real scrape

@pytest.fixture(scope="module")
async def scraped(tiny_llama_dir, tiny_llama_perturbed_dir, device) -> list[str]:
    """/metrics of a target, a draft and an orchestrator after one request through them."""
    orchestrator_metrics = OrchestratorMetrics()
    orchestrator_port = serve_metrics(orchestrator_metrics.registry, "127.0.0.1", 0)
    services, server, channel = {}, None, None
    # A test process is no service process: its heap is not frozen (gc.freeze) as a service's is.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specmesh.server.service, "freeze_start_up_heap", lambda process: 0)
        try:
            for role, directory in (("target", tiny_llama_dir), ("draft", tiny_llama_perturbed_dir)):
                options = ServiceOptions(model=str(directory), device=device, metrics_port=0, trace_exporter="none")
                services[role] = await start_model_service(ReplicaConfig(role, options),
                                                           make_engine(directory, device, role), create_model_server)
            options = OrchestratorOptions(
                target_endpoint=f"127.0.0.1:{services['target'].port}",
                draft_endpoint=f"127.0.0.1:{services['draft'].port}",
                loop=LoopConfig(num_speculative_tokens=3, adaptive_k=False))  # a fixed k: every round drafts
            _, tokenizer = load(str(tiny_llama_dir), device)
            server, port, _ = await create_orchestrator_server(tokenizer, options, metrics=orchestrator_metrics)
            channel = open_channel(f"127.0.0.1:{port}", None)
            request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[0], max_tokens=24, temperature=0.0,
                                                     prompt_class="code")
            async for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=WORK_TIMEOUT_S):
                pass
            # The request's totals are recorded as it finishes, which may follow its last response.
            await eventually(lambda: sum(sample.value for family in orchestrator_metrics.registry.collect()
                                         for sample in family.samples if sample.name == "specmesh_requests_total") == 1)
            ports = [orchestrator_port, *(service.metrics_port for service in services.values())]
            return [fetch_metrics(f"127.0.0.1:{p}", timeout=WORK_TIMEOUT_S) for p in ports]
        finally:
            if channel is not None:
                await channel.close()
            if server is not None:
                await server.stop(None)
            for service in services.values():
                await service.stop(0)


async def test_every_query_names_exported_series(dashboard, scraped):
    exported = exported_series(scraped)
    # the scrape is the services' own: request-level, per-position, round and KV series all present
    assert {"specmesh_spec_decode_num_accepted_tokens_per_pos_total", "specmesh_round_time_seconds_bucket",
            "specmesh_kv_cache_usage_perc", "specmesh_step_busy_seconds_total"} <= {
        name for name, labels in exported.items() if labels is not None}
    assert problems(dashboard, exported) == []


async def test_a_renamed_series_fails_the_check(dashboard, scraped):
    exported = exported_series(scraped)
    broken = copy.deepcopy(dashboard)
    target = next(t for p in panels_of(broken) for t in p.get("targets", []) if "generation_tokens" in t["expr"])
    target["expr"] = target["expr"].replace("specmesh_generation_tokens_total", "specmesh_generated_tokens_total")
    assert [p for p in problems(broken, exported) if "specmesh_generated_tokens_total is not exported" in p]
