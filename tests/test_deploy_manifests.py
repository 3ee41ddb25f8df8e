"""deploy/kuberay validates offline: Kubernetes kinds against the Kubernetes schemas, the RayCluster
against KubeRay's CRD schema (vendored in tests/schemas), and the pieces agree with each other and
with the real CLI parser. No cluster, no network."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.cli.main import build_parser
from specmesh.server.drain import STOP_MARGIN_S, stop_bound_s

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
KUBERNETES_VERSION = "1.30"
CRD_SCHEMA = Path(__file__).resolve().parent / "schemas" / "kuberay-raycluster-v1.yaml"


def load_documents() -> dict[tuple[str, str], dict]:
    """(kind, name) -> document, over every manifest in deploy/kuberay."""
    documents = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") != "Kustomization":
                documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


DOCUMENTS = load_documents()


def strict(schema):
    """The CRD schema with unknown fields refused (kubectl --validate=strict does the same)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


RAYCLUSTER_SCHEMA = strict(yaml.safe_load(CRD_SCHEMA.read_text()))


def pod_templates(cluster: dict) -> dict[str, dict]:
    templates = {"head": cluster["spec"]["headGroupSpec"]["template"]}
    templates.update({group["groupName"]: group["template"] for group in cluster["spec"]["workerGroupSpecs"]})
    return templates


def validate_raycluster(cluster: dict) -> None:
    jsonschema.validate(cluster, RAYCLUSTER_SCHEMA)
    for template in pod_templates(cluster).values():  # the subtrees the vendored schema elides
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES_VERSION, strict=True)


def raycluster() -> dict:
    return DOCUMENTS[("RayCluster", "specmesh")]


def container(template: dict, name: str) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


def serve_args() -> list[str]:
    driver = container(raycluster()["spec"]["headGroupSpec"]["template"], "specmesh")
    assert driver["command"] == ["specmesh"]
    return driver["args"]


def serve_config_text() -> str:
    """The driver's --config file: the ConfigMap mounted where its --config points."""
    head = raycluster()["spec"]["headGroupSpec"]["template"]
    args, mounts = serve_args(), {m["name"]: m["mountPath"] for m in container(head, "specmesh")["volumeMounts"]}
    path = Path(args[args.index("--config") + 1])
    volume = next(v for v in head["spec"]["volumes"] if mounts.get(v["name"]) == str(path.parent))
    return DOCUMENTS[("ConfigMap", volume["configMap"]["name"])]["data"][path.name]


def parsed_serve_args(tmp_path: Path):
    """The driver's command line through the real parser, its config file copied out of the ConfigMap."""
    args = serve_args()
    config = tmp_path / "serve.yaml"
    config.write_text(serve_config_text())
    return build_parser().parse_args([str(config) if arg == args[args.index("--config") + 1] else arg
                                      for arg in args])


def test_manifests_exist_and_the_kustomization_lists_them():
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    assert all((KUBERAY / resource).is_file() for resource in kustomization["resources"])
    kinds = {kind for kind, _ in DOCUMENTS}
    assert {"RayCluster", "Service", "Secret"} <= kinds


@pytest.mark.parametrize("key", [k for k in DOCUMENTS if k[0] != "RayCluster"], ids=lambda k: "/".join(k))
def test_kubernetes_objects_validate_against_the_kubernetes_schema(key):
    kubernetes_validate.validate(DOCUMENTS[key], KUBERNETES_VERSION, strict=True)


def test_raycluster_validates_against_the_kuberay_crd_schema():
    validate_raycluster(raycluster())


@pytest.mark.parametrize("breakage", ["minReplicas as text", "unknown group field", "pod spec typo",
                                      "missing groupName"])
def test_validation_catches_broken_manifests(breakage):
    """The checks above are not vacuous: each of these edits makes them fail."""
    cluster = copy.deepcopy(raycluster())
    group = cluster["spec"]["workerGroupSpecs"][0]
    if breakage == "minReplicas as text":
        group["minReplicas"] = "one"
    elif breakage == "unknown group field":
        group["maxReplica"] = 3
    elif breakage == "pod spec typo":
        group["template"]["spec"]["containers"][0]["resource"] = {}
    else:
        del group["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        validate_raycluster(cluster)


def test_pools_are_separate_worker_groups_with_their_own_sizes():
    groups = {group["groupName"]: group for group in raycluster()["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"draft", "target"}
    for group in groups.values():
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    target_limits = container(groups["target"]["template"], "ray-worker")["resources"]["limits"]
    assert int(target_limits["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" not in container(groups["draft"]["template"], "ray-worker")["resources"]["limits"]


def cpu_quantity(text) -> float:
    """A Kubernetes CPU quantity ("4", "500m") in CPUs."""
    text = str(text)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ray_start_resources(params: dict) -> dict[str, float]:
    """The custom resources of rayStartParams, KubeRay's form: '"{\\"name\\": 1}"'."""
    text = params.get("resources")
    return json.loads(text.strip('"').replace('\\"', '"')) if text else {}


def offered(group_spec: dict, container_name: str) -> dict[str, float]:
    """What each pod of a group offers Ray: KubeRay starts Ray with its container's CPU and nvidia.com/gpu
    limits unless rayStartParams sets num-cpus / num-gpus, plus rayStartParams' custom resources."""
    params = group_spec["rayStartParams"]
    limits = container(group_spec["template"], container_name)["resources"]["limits"]
    offers = {"CPU": cpu_quantity(params.get("num-cpus", limits.get("cpu", 0))),
              "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))), **ray_start_resources(params)}
    return {name: amount for name, amount in offers.items() if amount}


def group_offers(cluster: dict) -> dict[str, dict[str, float]]:
    offers = {"head": offered(cluster["spec"]["headGroupSpec"], "ray-head")}
    offers.update({group["groupName"]: offered(group, "ray-worker") for group in cluster["spec"]["workerGroupSpecs"]})
    return offers


def asked(args, pool: str) -> dict[str, float]:
    """What `specmesh serve` asks Ray for each replica of a pool (orchestrator.control.ray_cli.pool_spec)."""
    get = lambda name: getattr(args, f"{pool}_{name}")  # noqa: E731
    asks = {"CPU": get("num_cpus"), "GPU": get("num_gpus"), **get("resources")}
    return {name: amount for name, amount in asks.items() if amount}


def per_pod(asks: dict[str, float], offers: dict[str, float]) -> int:
    """How many replicas asking `asks` one pod offering `offers` holds."""
    return min(int(offers.get(name, 0) // amount) for name, amount in asks.items())


def placement(cluster: dict, args) -> dict[str, list[str]]:
    """pool -> the groups whose pods can hold one of its replicas."""
    offers = group_offers(cluster)
    return {pool: [group for group, offer in offers.items() if per_pod(asked(args, pool), offer) > 0]
            for pool in ("draft", "target")}


def test_each_pool_asks_what_its_own_worker_group_offers_and_no_other(tmp_path):
    """Draft replicas only on the CPU group's pods, target replicas only on the GPU group's, none on the head
    (the orchestrator's pod); each group's pods hold the pool at its largest."""
    args = parsed_serve_args(tmp_path)
    cluster = raycluster()
    assert placement(cluster, args) == {"draft": ["draft"], "target": ["target"]}
    offers = group_offers(cluster)
    assert offers["target"]["GPU"] >= asked(args, "target")["GPU"] >= 1 and "GPU" not in offers["draft"]
    assert "CPU" not in offers["head"]
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    for pool in ("draft", "target"):
        largest = max(getattr(args, f"{pool}_replicas") or 1, getattr(args, f"{pool}_max_replicas") or 0)
        assert largest <= groups[pool]["maxReplicas"] * per_pod(asked(args, pool), offers[pool]), pool


@pytest.mark.parametrize("breakage", ["target group without the resource", "draft group with a GPU ask",
                                      "draft without its resource"])
def test_the_placement_check_catches_a_misplaced_pool(tmp_path, breakage):
    cluster, args = copy.deepcopy(raycluster()), parsed_serve_args(tmp_path)
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    if breakage == "target group without the resource":
        del groups["target"]["rayStartParams"]["resources"]
    elif breakage == "draft group with a GPU ask":
        args.draft_num_gpus = 1
    else:  # it would fit the GPU pods too
        args.draft_resources = {}
    assert placement(cluster, args) != {"draft": ["draft"], "target": ["target"]}


def test_serve_command_parses_with_the_cli(tmp_path):
    args = parsed_serve_args(tmp_path)
    assert args.address == "auto" and args.draft_resources == {"specmesh_draft": 1}
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 50051 and args.http_port == 8000
    assert args.tls_server_name == "specmesh-internal"


def test_security_settings_point_at_the_secrets():
    head = raycluster()["spec"]["headGroupSpec"]["template"]
    driver = container(head, "specmesh")
    env = {item["name"]: item for item in driver["env"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in driver["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in head["spec"]["volumes"]}
    tls_secret = DOCUMENTS[("Secret", volumes["tls"]["secret"]["secretName"])]
    for name in ("SPECMESH_TLS_CERT", "SPECMESH_TLS_KEY", "SPECMESH_TLS_CA", "SPECMESH_TLS_CLIENT_CERT",
                 "SPECMESH_TLS_CLIENT_KEY"):
        path = Path(env[name]["value"])
        assert str(path.parent) == mounts["tls"] and path.name in tls_secret["stringData"], name
    key_ref = env["SPECMESH_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key_ref["key"] in DOCUMENTS[("Secret", key_ref["name"])]["stringData"]


def test_service_selects_the_head_and_exposes_the_client_ports():
    service = DOCUMENTS[("Service", "specmesh")]
    assert service["spec"]["selector"] == {"ray.io/cluster": "specmesh", "ray.io/node-type": "head"}
    driver_ports = {port["name"]: port["containerPort"] for port in container(
        raycluster()["spec"]["headGroupSpec"]["template"], "specmesh")["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= set(driver_ports)
    args = serve_args()
    assert str(driver_ports["grpc"]) == args[args.index("--port") + 1]
    assert str(driver_ports["http"]) == args[args.index("--http-port") + 1]


def test_image_ray_version_matches_the_cluster():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE).group(1)
    assert raycluster()["spec"]["rayVersion"] == ray_version
    entrypoint = shlex.split(re.search(r'^ENTRYPOINT \["(\w+)"\]', dockerfile, re.MULTILINE).group(1))
    assert entrypoint == ["specmesh"]


def pre_stop_sleep_s(container_: dict) -> float:
    command = container_["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def test_pods_outlive_the_drivers_drain(tmp_path):
    """The driver drains within its bound after its preStop; Ray and the replicas stay up that long,
    and Kubernetes waits for all of it before SIGKILL."""
    grace = parsed_serve_args(tmp_path).shutdown_grace
    assert "shutdown-grace" in yaml.safe_load(serve_config_text()) and grace > 0
    templates = pod_templates(raycluster())
    driver_done_s = pre_stop_sleep_s(container(templates["head"], "specmesh")) + stop_bound_s(grace)
    assert pre_stop_sleep_s(container(templates["head"], "specmesh")) > 0  # endpoints go before the drain
    others = [("head", "ray-head")] + [(group, "ray-worker") for group in templates if group != "head"]
    for group, name in others:
        assert pre_stop_sleep_s(container(templates[group], name)) >= driver_done_s, group
    for group, template in templates.items():
        slowest = max(pre_stop_sleep_s(c) for c in template["spec"]["containers"])
        assert template["spec"]["terminationGracePeriodSeconds"] > max(slowest, driver_done_s) + STOP_MARGIN_S, group
