"""A served orchestrator over Ray pools, as the Ray tests drive it: greedy streams and their expected output."""

from __future__ import annotations

import asyncio
import time

import grpc

from harness import WORK_TIMEOUT_S
from orchestrator.control.pools import Pools
from parity import target_greedy
from specmesh.v1 import admin_pb2_grpc, generation_pb2, generation_pb2_grpc


class RayStack:
    def __init__(self, pools: Pools, servicer, server, channel: grpc.aio.Channel, target_dir: str):
        self.pools, self.servicer, self.server, self.channel = pools, servicer, server, channel
        self.target_dir = target_dir
        self.generation = generation_pb2_grpc.GenerationStub(channel)
        self.admin = admin_pb2_grpc.AdminStub(channel)

    async def generate(self, prompt: str, max_tokens: int, first_token: asyncio.Event | None = None) -> list[int]:
        tokens = []
        request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        async for response in self.generation.Generate(request, timeout=WORK_TIMEOUT_S):
            tokens.extend(response.token_ids)
            if first_token is not None:
                first_token.set()
        return tokens

    def expected(self, prompt: str, max_tokens: int) -> list[int]:
        return list(target_greedy(self.target_dir, "cpu", prompt, max_tokens))

    async def wait_serving(self, role: str, count: int, timeout_s: float = WORK_TIMEOUT_S) -> None:
        pool = self.pools.pools[role]
        deadline = time.monotonic() + timeout_s
        while len(pool.routable()) != count or len(pool.replicas) != count:
            assert time.monotonic() < deadline, (
                f"{role} pool: {pool.replicas}; controller actors {list(self.pools.controllers[role].actors)}, "
                f"draining {list(self.pools.controllers[role].draining)}, refresher {pool._task}")
            await asyncio.sleep(0.2)

    def actor(self, role: str, name: str):
        return self.pools.controllers[role].actors[name]
