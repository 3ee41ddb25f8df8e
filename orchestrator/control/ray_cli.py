"""The pool flags of `specmesh serve` and the Ray backend's pool options.

`specmesh serve` runs every replica as a Ray actor with --backend ray (the default
when --address is given); otherwise as a local child process under a supervisor.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from orchestrator.control.ray_controller import PoolSpec

from orchestrator.control.options import PoolsOptions
from specmesh.server.service import ReplicaConfig, ServiceOptions
from target_service.disagreements import disagreement_log_settings

LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # replicas talk gRPC; Ray's object store stays idle


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("replica pools (the --*-num-cpus/gpus/resources, --address and "
                                     "--ray-namespace flags are for --backend ray)")
    group.add_argument("--backend", choices=["local", "ray"], default=None,
                       help="local: every replica a child process of this one, restarted when it dies; ray: "
                            "every replica a Ray actor (default: ray with --address, else local)")
    group.add_argument("--address", default=None,
                       help="Ray cluster to join (e.g. 'auto' or HEAD_IP:6379); default: start a local one")
    group.add_argument("--ray-namespace", default="specmesh", help="Ray namespace of the replica actors")
    for role in ("draft", "target"):
        group.add_argument(f"--{role}-replicas", type=int, default=None, help=f"initial {role} replicas (default 1)")
        group.add_argument(f"--{role}-min-replicas", type=int, default=None, help="autoscaling lower bound")
        group.add_argument(f"--{role}-max-replicas", type=int, default=None, help="autoscaling upper bound")
        group.add_argument(f"--{role}-num-cpus", type=float, default=1.0, help=f"Ray CPUs per {role} replica")
        group.add_argument(f"--{role}-num-gpus", type=float, default=0.0,
                           help=f"Ray GPUs per {role} replica" + ("; > 1 shards the model over that many GPUs "
                                                                  "of one node" if role == "target" else ""))
        group.add_argument(f"--{role}-resources", type=_resources, default={}, metavar="JSON",
                           help=f"custom Ray resources per {role} replica, e.g. '{{\"specmesh_{role}\": 1}}', "
                                "to place the pool on its own worker group")
    group.add_argument("--load-per-replica", type=float, default=4.0,
                       help="autoscaling target: mean load per serving replica, in sessions' worth of work "
                            "(open and waiting sessions plus queued token rows / 8)")
    group.add_argument("--drain-grace", type=float, default=60.0,
                       help="seconds a removed replica waits for its sessions before it is killed")
    group.add_argument("--max-replica-failures", type=int, default=2,
                       help="replicas one request may lose before it is failed")


def _resources(text: str) -> dict[str, float]:
    try:
        resources = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(resources, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in resources.values()):
        raise argparse.ArgumentTypeError("a JSON object of resource name to positive amount")
    return resources


def backend_of(args: argparse.Namespace) -> str:
    return args.backend or ("ray" if args.address is not None else "local")


def replica_device(device: str, num_gpus: float) -> str:
    """'auto' (sharded by accelerate over the actor's GPUs) for more than one GPU."""
    if num_gpus > 1:
        return "auto"
    if num_gpus > 0 and device == "cpu":
        return "cuda"
    return device


def pool_spec(args: argparse.Namespace, role: str, model: str, device: str, dtype: str, tls=None,
              internal_token: str | None = None, **replica) -> PoolSpec:
    get = lambda name: getattr(args, f"{role}_{name}")  # noqa: E731
    num_cpus, num_gpus = get("num_cpus"), get("num_gpus")
    service = ServiceOptions(model=model, host=args.host, device=replica_device(device, num_gpus), dtype=dtype,
                             num_threads=max(1, math.floor(num_cpus)), trace_exporter=args.trace_exporter,
                             trace_sample_ratio=args.trace_sample_ratio, tls=tls, internal_token=internal_token,
                             kv_cache_memory=args.kv_cache_memory, max_waiting_sessions=args.max_waiting_sessions,
                             cpu_linear=args.cpu_linear, max_step_tokens=args.max_step_tokens,
                             prefill_slowdown=args.prefill_slowdown, trust_remote_code=args.trust_remote_code,
                             graph_steps=args.graph_steps)
    replicas = 1 if get("replicas") is None else get("replicas")
    return PoolSpec(ReplicaConfig(role, service, **replica), replicas=replicas, min_replicas=get("min_replicas"),
                    max_replicas=get("max_replicas"), num_cpus=num_cpus, num_gpus=num_gpus,
                    resources=get("resources"),
                    load_per_replica=args.load_per_replica, drain_grace_s=args.drain_grace)


def pools_options(args: argparse.Namespace, security=None, internal_token: str | None = None) -> PoolsOptions:
    """security: specmesh.server.security settings; replicas get the serving TLS material as bytes, and
    `internal_token` (required from the orchestrators that call them)."""
    server_tls = security.server_tls if security else None
    target = pool_spec(args, "target", args.target, args.device, args.target_dtype, server_tls, internal_token,
                       disagreement_log=disagreement_log_settings(args))
    draft = None
    if args.draft.lower() != "none" and args.draft_replicas != 0:
        draft = pool_spec(args, "draft", args.draft, args.draft_device or args.device, args.draft_dtype,
                          server_tls, internal_token, greedy_proposals=args.greedy_draft)
    return PoolsOptions(backend="ray", namespace=args.ray_namespace, target=target, draft=draft,
                        max_replica_failures=args.max_replica_failures,
                        channel_tls=security.channel_tls if security else None)


def local_cpus(options: PoolsOptions) -> int:
    """Logical CPUs for a local cluster: room for every pool at its largest (Ray oversubscribes)."""
    wanted = sum(spec.num_cpus * spec.bounds[1] for spec in (options.target, options.draft) if spec)
    if options.online_distill is not None:
        wanted += options.online_distill.cpus  # the distillation task's own CPUs
    return max(os.cpu_count() or 1, math.ceil(wanted))


def init_ray(address: str | None, namespace: str, options: PoolsOptions | None = None) -> None:
    import ray
    kwargs = dict(namespace=namespace, include_dashboard=False, log_to_driver=True)
    if address is None:
        kwargs.update(num_cpus=local_cpus(options) if options else None, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    ray.init(address=address, **kwargs)
