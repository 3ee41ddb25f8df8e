"""Replica pools under test: real gRPC servers at fixed addresses (Replicas), or `specmesh serve`'s own
local child processes (LocalDeployment), and a generation's loop over them."""

from __future__ import annotations

import functools
import os
import signal

import grpc

from harness import WORK_TIMEOUT_S, eventually, load, make_engine, start_model_server
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.serving.clients import DraftClient, TargetClient
from orchestrator.control.options import RestartPolicy
from orchestrator.serving.pool import PoolSpec, ReplicaPool, fixed_replicas
from orchestrator.control.pools import Pools
from orchestrator.control.options import PoolsOptions
from orchestrator.control.build import servicer_over_pools
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.service import ReplicaConfig, ServiceOptions

PROMPT = "The quick brown fox"
MAX_TOKENS = 48
RESTART_WAIT_S = 120.0  # a restarted child imports torch and loads its model: seconds, more on a busy machine


class Replicas:
    """n real gRPC servers of one role over engines of the same model, and a pool over them."""

    def __init__(self, role: str, servers: dict[str, grpc.aio.Server], addresses: dict[str, str],
                 round_calls: str = "unary"):
        self.role, self.servers, self.addresses = role, servers, addresses
        client = functools.partial(TargetClient if role == "target" else DraftClient, round_calls=round_calls)
        self.pool = ReplicaPool(role, fixed_replicas(addresses), client, check_interval_s=0.1)

    @classmethod
    async def start(cls, role: str, model_dir, count: int, round_calls: str = "unary") -> "Replicas":
        servers, addresses = {}, {}
        for index in range(count):
            server, port = await start_model_server(role, make_engine(model_dir, role_name=role))
            servers[f"{role}-{index}"], addresses[f"{role}-{index}"] = server, f"127.0.0.1:{port}"
        replicas = cls(role, servers, addresses, round_calls)
        await replicas.pool.wait_serving(count, timeout=WORK_TIMEOUT_S)
        return replicas

    async def stop(self, name: str) -> None:
        await self.servers.pop(name).stop(None)

    async def restart(self, name: str, model_dir) -> None:
        """The replica back at its old address, empty (as a restarted process comes back)."""
        port = int(self.addresses[name].rsplit(":", 1)[1])
        self.servers[name], _ = await start_model_server(self.role, make_engine(model_dir, role_name=self.role),
                                                         port=port)

    async def stop_all(self) -> None:
        for name in list(self.servers):
            await self.stop(name)


def generation(tokenizer, target, draft, k: int = 2, loop=SpeculativeGeneration, policy=None,
               prompt: str = PROMPT) -> SpeculativeGeneration:
    request = GenerationRequest(request_id="r", prompt_token_ids=tokenizer.encode(prompt), max_tokens=MAX_TOKENS,
                                sampling=SamplingParams(temperature=0.0), stop=[], num_speculative_tokens=k)
    return loop(request, target, draft, {tokenizer.eos_token_id}, LoopConfig(num_speculative_tokens=k), policy=policy)


def placed(client, generation_: SpeculativeGeneration) -> str:
    return client.sessions[generation_.session_id].replica.name


class LocalDeployment:
    """Pools of local child processes and the Generation servicer over them, as `specmesh serve` builds them."""

    def __init__(self, pools: Pools, servicer, metrics: OrchestratorMetrics):
        self.pools, self.servicer, self.metrics = pools, servicer, metrics

    @classmethod
    async def start(cls, target_dir, draft_dir, policy: RestartPolicy) -> "LocalDeployment":
        spec = lambda role, model: PoolSpec(ReplicaConfig(role, ServiceOptions(model=str(model))))  # noqa: E731
        options = PoolsOptions(backend="local", target=spec("target", target_dir),
                               draft=spec("draft", draft_dir), check_interval_s=0.1,
                               acquire_timeout_s=RESTART_WAIT_S, restart_policy=policy)
        pools = Pools.from_options(options, metrics=OrchestratorMetrics())
        _, tokenizer = load(str(target_dir), "cpu")
        servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=2))
        return cls(pools, servicer, pools.metrics)

    def replica(self, role: str):
        (replica,) = self.pools.controllers[role].replicas.values()
        return replica

    def kill(self, role: str) -> str:
        """SIGKILL the role's (only) replica; returns the address it served on."""
        replica = self.replica(role)
        address = replica.address.result()
        os.kill(replica.process.pid, signal.SIGKILL)
        return address

    async def wait_serving_elsewhere(self, role: str, old_address: str) -> None:
        """Until the pool routes to the role's replica again, at a new address (a new incarnation)."""
        pool = self.pools.pools[role]
        await eventually(lambda: any(r.address != old_address for r in pool.routable()), timeout_s=RESTART_WAIT_S)

    def generation(self, tokenizer, k: int = 2) -> SpeculativeGeneration:
        backends = self.servicer.backends
        request = GenerationRequest(request_id="r", prompt_token_ids=tokenizer.encode(PROMPT), max_tokens=MAX_TOKENS,
                                    sampling=SamplingParams(temperature=0.0), stop=[], num_speculative_tokens=k)
        return SpeculativeGeneration(request, backends.target, backends.draft, backends.eos_token_ids,
                                     LoopConfig(num_speculative_tokens=k))

    def restarts(self, role: str) -> float:
        return self.metrics.registry.get_sample_value("specmesh_replica_restarts_total", {"role": role}) or 0.0
