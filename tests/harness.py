"""Start the three real gRPC servers in-process on 127.0.0.1:0 over tiny models."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from prometheus_client import CollectorRegistry

from benchmarks.links import DelayLine, LinkSpec
from orchestrator.serving.clients import open_channel
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.replicas import create_model_server
from orchestrator.control.build import create_server as create_orchestrator_server
from specmesh.engine.model_engine import EngineConfig, ModelEngine
from specmesh.engine.kv_budget import KVCacheMemory
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.loading.cpu_linear import choose_cpu_linear
from specmesh.loading.precision import load_model_in
from specmesh.roles import role
from specmesh.server.security import TLSConfig, bearer_metadata, token_interceptors
from specmesh.server.service import ReplicaConfig, ServiceOptions
from specmesh.engine.step_costs import StepCosts
from specmesh.v1 import common_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2_grpc

# The deadline of a wait on work finishing (a generation, a session closing, a server stopping):
# sized for a 2-core machine that runs other jobs beside the suite, where work the tiny models do
# in a second can take tens. A wait ends at its event; only a test that fails waits this long.
WORK_TIMEOUT_S = 120.0

def serve_config(directory: Path, **settings) -> list[str]:
    """`specmesh serve`'s `--config FILE` arguments for settings only a config file sets (given by dest)."""
    path = Path(directory) / "serve.yaml"
    path.write_text(yaml.safe_dump({name.replace("_", "-"): value for name, value in settings.items()}))
    return ["--config", str(path)]


async def eventually(probe, wanted=True, timeout_s: float = WORK_TIMEOUT_S) -> None:
    """Until `probe()` (awaited when it returns an awaitable) gives `wanted`; fails the test at the
    deadline. It polls: what it waits on lives in another thread or process, with no event to await."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (got := await _value_of(probe())) != wanted:
        assert asyncio.get_running_loop().time() < deadline, f"still {got!r}, waiting for {wanted!r}"
        await asyncio.sleep(0.02)


async def _value_of(result):
    return await result if inspect.isawaitable(result) else result


class FixedStepCosts(StepCosts):
    """A step-cost table a test sets: what steps take fits nothing (the model stays the table as it is)."""

    def observe(self, shape, seconds: float) -> None:
        pass


class RowMultipleCosts(FixedStepCosts):
    """Step costs under which a forward of n > 1 rows is padded to a multiple of `multiple` rows, as
    on a CPU whose GEMM costs one weight pass for 4 or 8 rows and one per row for 2, 3 or 5-7."""

    def __init__(self, multiple: int):
        super().__init__({rows: 1.0 for rows in (1, 2, 4, 8, 16, 32, 64)})
        self.multiple = multiple

    def padding(self, rows: int) -> int:
        return 0 if rows <= 1 else -rows % self.multiple


class TargetHold:
    """Lets the engine's next job (a new session's prefill) run, then holds its worker until
    released, so a generation stays mid-way however fast the tiny models are. The hold is armed on
    the worker as that job ends and taken as the next step starts: no window in which the generation
    runs on."""

    def __init__(self, engine) -> None:
        self.engine, self.gate, self.held = engine, threading.Event(), threading.Event()
        self._submit, self._run_step = engine.submit, engine.scheduler.run_step
        self._armed = False
        engine.submit = self._first_submit
        engine.scheduler.run_step = self._step

    async def _first_submit(self, session, job):
        self.engine.submit = self._submit

        def job_then_hold():
            try:
                return (yield from job)
            finally:
                self._armed = True
        return await self._submit(session, job_then_hold())

    def _step(self, parts):
        if self._armed:
            self._armed = False
            self.held.set()
            self.gate.wait(2 * WORK_TIMEOUT_S)  # release() ends it; this only bounds a test that never does
        return self._run_step(parts)

    async def wait_held(self) -> None:
        assert await asyncio.to_thread(self.held.wait, WORK_TIMEOUT_S), "the engine's next forward never ran"

    def release(self) -> None:
        self.engine.submit = self._submit
        self.engine.scheduler.run_step = self._run_step
        self.gate.set()

    async def __aenter__(self) -> "TargetHold":
        return self

    async def __aexit__(self, *_) -> None:
        self.release()


@functools.lru_cache(maxsize=16)
def load(model_dir: str, device: str, dtype: str = "float32", cpu_linear: str = "torch",
         trust_remote_code: bool = False):
    """Models are read-only once loaded, so tests share them across stacks. `dtype`: a --dtype name;
    `cpu_linear`: the kernel of float32 Linear layers (specmesh.loading.cpu_linear; tests pick one, never auto)."""
    model, tokenizer = load_model_in(model_dir, device, dtype, trust_remote_code=trust_remote_code)
    choose_cpu_linear(model, cpu_linear, device)
    return model, tokenizer


# Graph steps over preallocated KV slots (specmesh.engine.graph_steps), eager on a CPU, in a small budget.
GRAPH_STEPS = dict(graph_steps="on", max_sessions=8, kv_cache_memory=KVCacheMemory(bytes=2**23))
# On CUDA every engine preallocates its KV budget (graph steps): tests that open several engines at once
# would otherwise each take 0.8 of the free memory.
CUDA_TEST_KV = KVCacheMemory(bytes=2**28)


def make_engine(model_dir: Path | str, device: str = "cpu", role_name: str = "target",
                row_multiple: int = 1, dtype: str = "float32", cpu_linear: str = "torch",
                trust_remote_code: bool = False, **config) -> ModelEngine:
    """`row_multiple` > 1: every forward of more rows than one is padded to a multiple of it (RowMultipleCosts);
    `config`: more EngineConfig fields."""
    model, tokenizer = load(str(model_dir), device, dtype, cpu_linear, trust_remote_code)
    if device.startswith("cuda"):
        config.setdefault("kv_cache_memory", CUDA_TEST_KV)
    engine = ModelEngine(model, tokenizer, EngineConfig(model_name=str(model_dir),
                                                        generator_salt=role(role_name).generator_salt, **config))
    if row_multiple > 1:
        engine.costs = RowMultipleCosts(row_multiple)
    return engine


async def start_model_server(role_name: str, engine: ModelEngine, tls: TLSConfig | None = None,
                             internal_token: str | None = None, port: int = 0,
                             **config) -> tuple[grpc.aio.Server, int]:
    """A draft or target server on 127.0.0.1:port (0: any), started the way every deployment starts one."""
    options = ServiceOptions(model=engine.config.model_name, tls=tls, port=port, internal_token=internal_token)
    server, port, _ = await create_model_server(ReplicaConfig(role_name, options, **config), engine)
    return server, port


@dataclass
class Stack:
    target_engine: ModelEngine
    draft_engine: ModelEngine | None
    target_port: int
    draft_port: int | None
    port: int
    servers: dict[str, grpc.aio.Server] = field(default_factory=dict)
    channel: grpc.aio.Channel | None = None
    channel_tls: TLSConfig | None = None  # the orchestrator's identity towards the draft and target
    api_key: str | None = None
    internal_token: str | None = None  # the draft and target require it; the orchestrator sends it
    links: list[DelayLine] = field(default_factory=list)  # between the orchestrator and the draft and target

    def internal_channel(self, port: int) -> grpc.aio.Channel:
        """A channel to the draft or target as the orchestrator has one (its TLS identity and token)."""
        return open_channel(f"127.0.0.1:{port}", self.channel_tls, token_interceptors(self.internal_token))

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    async def generate(self, **fields) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
        """Run one Generate stream; return (token ids, text, last response)."""
        token_ids, text, last = [], [], None
        async for response in self.stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=WORK_TIMEOUT_S,
                                                 metadata=bearer_metadata(self.api_key)):
            token_ids.extend(response.token_ids)
            text.append(response.text)
            last = response
        return token_ids, "".join(text), last

    async def open_sessions(self) -> tuple[int, int]:
        target = target_pb2_grpc.TargetServiceStub(self.internal_channel(self.target_port))
        info = await target.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
        draft_count = len(self.draft_engine.sessions) if self.draft_engine else 0
        return info.open_sessions, draft_count

    async def wait_sessions_freed(self, timeout_s: float = WORK_TIMEOUT_S) -> tuple[int, int]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        counts = await self.open_sessions()
        while counts != (0, 0) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            counts = await self.open_sessions()
        return counts

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        for server in self.servers.values():
            await server.stop(None)
        for line in self.links:
            await line.stop()


async def start_stack(target_dir, draft_dir=None, *, device: str = "cpu", k: int = 2,
                      greedy_proposals: bool = False, draft_timeout_s: float = 10.0,
                      metrics: OrchestratorMetrics | None = None, disagreements=None,
                      adaptive_k: bool = False, server_tls: TLSConfig | None = None,
                      channel_tls: TLSConfig | None = None, client_tls: TLSConfig | None = None,
                      api_key: str | None = None, pipeline: str = "auto", extra_branches: int | None = None,
                      internal_token: str | None = None, loop_options: dict | None = None,
                      calibrate: bool = False, draft_dtype: str = "float32", draft_cost_scale: float = 1.0,
                      cpu_linear: str = "torch", target_step_costs: dict[int, float] | None = None,
                      draft_step_costs: dict[int, float] | None = None,
                      trust_remote_code: bool = False, engine_config: dict | None = None,
                      link: LinkSpec | None = None) -> Stack:
    """Three in-process servers; k is fixed per round unless adaptive_k (the serving default) is asked for.

    `server_tls`: all three servers; `channel_tls`: the orchestrator's channels to the draft and
    target; `client_tls`: the stack's own channel to the orchestrator; `api_key`: required and sent;
    `internal_token`: required by the draft and target, sent by the orchestrator.
    `pipeline`: LoopConfig.pipeline ("auto" is sequential here: all three share this process's CPUs);
    `loop_options`: more LoopConfig fields; `calibrate`: the services measure their step costs first,
    as they do when served (then the orchestrator's policy prices rounds from them); `draft_dtype`: the
    draft's --dtype name; `draft_cost_scale`: the calibrated draft reports its steps this many times their
    measured cost (a tiny draft the size of its target stands in for a cheaper one); `cpu_linear`: both
    services' float32 Linear kernel; `target_step_costs`: after calibration the target reports (and
    keeps) this table instead of its own (FixedStepCosts), where pricing is an input and not the subject;
    `draft_step_costs`: the same for the draft (draft_cost_scale then unused).
    `trust_remote_code`: both models may run the code their directories ship (the set-acceptance pair);
    `engine_config`: more EngineConfig fields for both services; `link`: the orchestrator reaches the draft
    and the target each through a delay line of that round trip and bandwidth (benchmarks/links.py)."""
    target_engine = make_engine(target_dir, device, "target", cpu_linear=cpu_linear,
                                trust_remote_code=trust_remote_code, **(engine_config or {}))
    if calibrate:
        target_engine.calibrate()
        if target_step_costs is not None:
            target_engine.costs = FixedStepCosts(target_step_costs)
    target_server, target_port = await start_model_server("target", target_engine, server_tls, internal_token,
                                                          extra=dict(disagreements=disagreements))
    servers = {"target": target_server}
    draft_engine, draft_port = None, None
    if draft_dir is not None:
        draft_engine = make_engine(draft_dir, device, "draft", dtype=draft_dtype, cpu_linear=cpu_linear,
                                   trust_remote_code=trust_remote_code, **(engine_config or {}))
        if calibrate:
            measured = draft_engine.calibrate().measured
            draft_engine.costs = (FixedStepCosts(draft_step_costs) if draft_step_costs is not None else
                                  StepCosts({rows: seconds * draft_cost_scale for rows, seconds in measured.items()}))
        servers["draft"], draft_port = await start_model_server("draft", draft_engine, server_tls, internal_token,
                                                                greedy_proposals=greedy_proposals)
    links = {role: await DelayLine(("127.0.0.1", port), link, name=role).start()
             for role, port in (("target", target_port), ("draft", draft_port)) if link is not None and port}
    target_seen, draft_seen = (links[role].port if role in links else port
                               for role, port in (("target", target_port), ("draft", draft_port)))
    options = OrchestratorOptions(
        target_endpoint=f"127.0.0.1:{target_seen}",
        draft_endpoint=f"127.0.0.1:{draft_seen}" if draft_port else None,
        loop=LoopConfig(num_speculative_tokens=k, draft_timeout_s=draft_timeout_s, adaptive_k=adaptive_k,
                        pipeline=pipeline, extra_branches=extra_branches, **(loop_options or {})),
        channel_tls=channel_tls, internal_token=internal_token)
    _, tokenizer = load(str(target_dir), device, trust_remote_code=trust_remote_code)
    servers["orchestrator"], port, _ = await create_orchestrator_server(tokenizer, options, metrics=metrics,
                                                                        tls=server_tls, api_key=api_key)
    stack = Stack(target_engine, draft_engine, target_port, draft_port, port, servers,
                  channel_tls=channel_tls, api_key=api_key, internal_token=internal_token,
                  links=list(links.values()))
    stack.channel = open_channel(f"127.0.0.1:{port}", client_tls)
    return stack


def draft_stub(stack: Stack) -> draft_pb2_grpc.DraftServiceStub:
    return draft_pb2_grpc.DraftServiceStub(stack.internal_channel(stack.draft_port))


def metric(registry: CollectorRegistry, name: str, **labels) -> float:
    """Sum of a sample over every label set that matches `labels`."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
