"""Draft and target services started elsewhere, attached to `specmesh serve` by address.

The config keys `target-endpoints` and `draft-endpoints` name services that other means started
(`python -m target_service` on another machine, a Kubernetes Deployment). `specmesh serve` starts
no replica of such a role: its pool discovers exactly those addresses and routes, health-checks,
fails over and drains among them as among its own replicas (orchestrator.serving.pool). Only
their lifecycle is not this orchestrator's: it does not restart, scale or roll them out
(ScalePool / ReplaceModel answer FAILED_PRECONDITION), and a service that drains says so on its
own health (NOT_SERVING), which is what stops new sessions going there.

An attached replica is named `<role>-ext-<i>`, in the order of its role's endpoints. The
orchestrator sends the attached services the token of `internal-token-file` (the one they were
started with); without one it sends none, as a service without one requires none.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import replace
from typing import Iterable, Sequence

from orchestrator.control.options import PoolsOptions
from orchestrator.serving.pool import PoolHooks, ReplicaPool, fixed_replicas, new_pool
from orchestrator.control.config_error import ConfigError
from specmesh.errors import NotManagedHere
from specmesh.server.security import add_internal_token_arguments, internal_token_from_args, token_interceptors

log = logging.getLogger(__name__)
ROLES = ("target", "draft")
ATTACHED_DRAFT_WAIT_S = 10.0  # at start-up; then requests go target-only until an attached draft serves
_POLL_S = 0.1  # start-up: how often the pool's own health checks are looked at


class AttachedUnavailable(RuntimeError):
    """At start-up: no attached service of a role serves this orchestrator."""


# ---- the settings


def parse_endpoint(text: str) -> str:
    """'host:port' (an IPv6 host in brackets: '[::1]:50061'), checked; the port as a plain number."""
    host, colon, port = text.strip().rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not host:port")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: an IPv6 address goes in brackets, e.g. [::1]:50061")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: the port must be a number from 1 to 65535")
    return f"{host}:{int(port)}"


def parse_endpoints(text: str) -> tuple[str, ...]:
    """'h1:50061,h2:50061' (a config file's YAML list arrives joined with commas) -> ('h1:50061', 'h2:50061')."""
    parts = text.split(",")
    if any(not part.strip() for part in parts):
        raise argparse.ArgumentTypeError("an empty endpoint: give one or more host:port")
    endpoints = tuple(parse_endpoint(part) for part in parts)
    repeated = sorted({endpoint for endpoint in endpoints if endpoints.count(endpoint) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once")
    return endpoints


def add_attached_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("attached services (draft and target services started elsewhere)")
    for role in ROLES:
        group.add_argument(f"--{role}-endpoints", type=parse_endpoints, default=None, metavar="HOST:PORT,...",
                           help=f"use the {role} services running at these addresses instead of starting {role} "
                                f"replicas: the {role} pool is exactly them ({role}-ext-0, {role}-ext-1, ...)")
    add_internal_token_arguments(group, serving=False, what="send the attached services this internal token, the "
                                                            "one they were started with (default: none)")


def attach_endpoints(options: PoolsOptions, args: argparse.Namespace) -> PoolsOptions:
    """`options` with the roles that have endpoints attached instead of started; ConfigError on a contradiction,
    SecurityConfigError on an unreadable token file."""
    attached = {role: getattr(args, f"{role}_endpoints") for role in ROLES if getattr(args, f"{role}_endpoints")}
    if not attached:
        if args.internal_token_file:
            log.warning("internal-token-file is for attached services (target-endpoints, draft-endpoints); "
                        "none are given, so it is not used")
        return options
    _refuse_contradictions(args, attached)
    token = internal_token_from_args(args)
    if token is None:
        _warn_no_token(attached, options)
    return replace(options, attached=attached, attached_token=token,
                   target=None if "target" in attached else options.target,
                   draft=None if "draft" in attached else options.draft)


def _refuse_contradictions(args: argparse.Namespace, attached: dict[str, tuple[str, ...]]) -> None:
    for role in attached:
        for size in ("replicas", "min-replicas", "max-replicas"):
            if getattr(args, f"{role}_{size.replace('-', '_')}") is not None:
                raise ConfigError(f"{role}-{size} sizes the {role} replicas serve starts, but {role}-endpoints "
                                  f"attaches {role} services instead: give one of the two")
    if "draft" in attached and args.draft.lower() == "none":
        raise ConfigError("draft-endpoints attaches draft services, but draft is 'none' (target-only): give one "
                          "of the two")


def _warn_no_token(attached: dict[str, tuple[str, ...]], options: PoolsOptions) -> None:
    mutual = options.channel_tls is not None and options.channel_tls.cert is not None
    log.warning("no internal-token-file: the orchestrator sends no internal token to the attached services (%s). "
                "They must require none (started without --internal-token-file), which admits anyone who "
                "reaches them%s", ", ".join(a for addresses in attached.values() for a in addresses),
                "; mutual TLS admits only certificates of its CA" if mutual else
                ", unless they require mutual TLS (tls-ca, with tls-client-cert here)")


# ---- the pools


def replica_names(role: str, addresses: Sequence[str]) -> dict[str, str]:
    return {f"{role}-ext-{index}": address for index, address in enumerate(addresses)}


def attached_pools(options: PoolsOptions, interceptors: Sequence = (),
                   hooks: PoolHooks = PoolHooks()) -> dict[str, ReplicaPool]:
    """A pool over each attached role's fixed addresses. `interceptors`: those of every channel to them (tracing);
    the attached services' token is added here."""
    interceptors = [*interceptors, *token_interceptors(options.attached_token)]
    return {role: new_pool(role, fixed_replicas(replica_names(role, addresses)), options.check_interval_s,
                           interceptors, options.channel_tls, hooks)
            for role, addresses in options.attached.items()}


async def wait_for_attached(pools: dict[str, ReplicaPool], roles: Iterable[str], timeout_s: float) -> None:
    """Start-up: until an attached target serves (one that refuses this orchestrator fails at once); an
    attached draft gets ATTACHED_DRAFT_WAIT_S, then requests go target-only until one serves."""
    roles = set(roles)
    if "target" in roles:
        await wait_routable(pools["target"], timeout_s)
    if "draft" in roles:
        try:
            await wait_routable(pools["draft"], ATTACHED_DRAFT_WAIT_S)
        except AttachedUnavailable as error:
            log.warning("%s; serving target-only until one passes its health checks", error)


async def wait_routable(pool: ReplicaPool, timeout_s: float) -> None:
    """Until the running pool routes to one replica; AttachedUnavailable when every replica refuses this
    orchestrator (a wrong token does not fix itself) or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while not pool.routable():
        refusing = pool.refusing()
        if refusing and len(refusing) == len(pool.replicas):
            raise AttachedUnavailable(f"every attached {pool.role} service refuses this orchestrator "
                                      f"(UNAUTHENTICATED: {_listed(refusing)}); internal-token-file must hold "
                                      "the token they were started with")
        if time.monotonic() > deadline:
            raise AttachedUnavailable(f"no attached {pool.role} service passed its health checks within "
                                      f"{timeout_s:g} s ({_listed(pool.replicas.values())})")
        await asyncio.sleep(_POLL_S)


def _listed(replicas) -> str:
    return ", ".join(f"{replica.name} at {replica.address or 'unresolved'}" for replica in replicas)


def not_managed(role: str, act: str) -> NotManagedHere:
    """ScalePool / ReplaceModel on an attached role."""
    return NotManagedHere(f"the {role} pool is the services attached by {role}-endpoints, which this orchestrator "
                          f"did not start: it cannot {act}; do it where they run, and list them in {role}-endpoints")
