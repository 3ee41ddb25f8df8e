"""Link faults between the orchestrator and its services: a link that stalls or resets mid-generation.

Real draft and target services over the tiny models, each reached through an emulated link
(`benchmarks.links.DelayLine`, 1 ms rtt), attached by the links' addresses to an orchestrator built
as `specmesh serve` builds one (tests/attached.py): every call, round stream, PreDraft
stream and health check crosses a link. The request a fault hits is driven through the loop over the
orchestrator's own pooled clients: its token stream is an async generator, so the fault lands
between two exact rounds (as in tests/test_pool_failover.py). Requests after a fault go through the
Generation API, as a client's would.

A fault must never hang a request nor change what it streams: a request ends within the deadline
that governs the call the fault caught (the draft's per-round timeout, the target's per-call one),
plus a generous margin for a loaded 2-core host; only lower-level timings are left unasserted.

The last tests check when a call in flight is abandoned because the pool's health checks found its
replica unreachable, over scripted replicas (health checks and a target that answer when the test says),
so that a check fails exactly while a call waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2

from attached import Orchestrator, Service, serve_args, start_service, stop_all, token_file_in
from benchmarks.links import DelayLine, LinkSpec
from harness import WORK_TIMEOUT_S, eventually, load
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.pipelined import PipelinedGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.serving.failover import PooledTargetClient
from orchestrator.serving.pool import (CHECK_TIMEOUT_S, UNREACHABLE_AFTER_FAILED_CHECKS, Replica, ReplicaPool,
                                       fixed_replicas)
from parity import target_greedy
from pools import placed
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc, target_pb2

PROMPT = "The quick brown fox"  # the tiny target runs it 40 tokens without an EOS
MAX_TOKENS = 40
K = 3
FAULT_ROUND = 2  # the fault lands after this round: the draft has had tokens accepted by then
LINK = LinkSpec(rtt_ms=1.0)
DRAFT_TIMEOUT_S = 0.5  # the loop's per-round deadline on the draft (draft-timeout; 5 s by default)
TARGET_TIMEOUT_S = 3.0  # the loop's per-call deadline on the target, for a request a fault hits (120 s by default)
# A stall is found by health checks failing in a row (each CHECK_TIMEOUT_S): the Verify a stall catches gets a
# deadline well past that, so that only a failover, not the deadline, can end its wait.
STALLED_VERIFY_TIMEOUT_S = UNREACHABLE_AFTER_FAILED_CHECKS * CHECK_TIMEOUT_S + 6.0
# How far past the deadline that governs it a faulted request may end: generous for a loaded 2-core host,
# and still short of what a hang would take (a draft timeout every round of 40: 20 s; the target's 120 s).
SLACK_S = 10.0
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=7)


@dataclass
class LinkedStack:
    """Target and draft services, each behind its own link, and the orchestrator attached to the links."""

    orchestrator: Orchestrator
    services: list[Service]
    target_links: dict[str, DelayLine]  # by the replica's name in the pool: target-ext-0, ...
    draft_link: DelayLine
    tokenizer: object

    @property
    def backends(self):
        return self.orchestrator.servicer.backends

    @property
    def draft_replica(self) -> Replica:
        return self.orchestrator.pool("draft").replicas["draft-ext-0"]

    def target_replica(self, name: str) -> Replica:
        return self.orchestrator.pool("target").replicas[name]

    def generation(self, loop=SpeculativeGeneration, sampling: SamplingParams = GREEDY,
                   target_timeout_s: float = TARGET_TIMEOUT_S) -> SpeculativeGeneration:
        """A request at fixed k through the orchestrator's pooled clients, with the test's deadlines."""
        request = GenerationRequest(request_id="faulted", prompt_token_ids=self.tokenizer.encode(PROMPT),
                                    max_tokens=MAX_TOKENS, sampling=sampling, stop=[], num_speculative_tokens=K,
                                    fixed_k=True)
        config = LoopConfig(num_speculative_tokens=K, draft_timeout_s=DRAFT_TIMEOUT_S,
                            target_timeout_s=target_timeout_s)
        return loop(request, self.backends.target, self.backends.draft, self.backends.eos_token_ids, config)

    async def generate(self) -> tuple[list[int], generation_pb2.GenerationStats, float]:
        """A greedy request through the Generation API: (token ids, its stats, seconds it took)."""
        stub = generation_pb2_grpc.GenerationStub(self.orchestrator.channel)
        request = generation_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        started, tokens, last = time.monotonic(), [], None
        async for response in stub.Generate(request, timeout=WORK_TIMEOUT_S):
            tokens.extend(response.token_ids)
            last = response
        return tokens, last.stats, time.monotonic() - started


@contextlib.asynccontextmanager
async def linked_stack(tmp_path, target_dir, draft_dir, targets: int = 1, pipeline: str = "off",
                       round_calls: str = "batch"):
    services, links = [], []
    orchestrator = None
    try:
        for role, model_dir in [*[("target", target_dir)] * targets, ("draft", draft_dir)]:
            services.append(await start_service(role, model_dir))
            links.append(await DelayLine(("127.0.0.1", services[-1].port), LINK, name=role).start())
        args = serve_args(tmp_path, target_endpoints=[link.address for link in links[:-1]],
                          draft_endpoints=[links[-1].address], internal_token_file=str(token_file_in(tmp_path)),
                          speculation_policy="fixed", num_speculative_tokens=K, draft_timeout=DRAFT_TIMEOUT_S,
                          pipeline=pipeline, round_calls=round_calls)
        orchestrator = await Orchestrator.start(target_dir, args)
        await orchestrator.pool("target").wait_serving(targets, WORK_TIMEOUT_S)
        await orchestrator.pool("draft").wait_serving(1, WORK_TIMEOUT_S)
        yield LinkedStack(orchestrator, services, {f"target-ext-{i}": link for i, link in enumerate(links[:-1])},
                          links[-1], load(str(target_dir), "cpu")[1])
    finally:
        if orchestrator is not None:
            await orchestrator.stop()
        for link in links:
            await link.stop()
        await stop_all(*services)


def expected(model_dir) -> list[int]:
    return list(target_greedy(str(model_dir), "cpu", PROMPT, MAX_TOKENS))


class FaultedRun:
    """One request run to its end with a fault injected between two rounds; what it streamed, and when."""

    def __init__(self, gen: SpeculativeGeneration):
        self.gen = gen
        self.tokens: list[int] = []  # all it streamed
        self.tokens_before = 0  # streamed when the fault came
        self.draft_tokens_before = 0  # drafted by then
        self.draft_tokens_at_recovery = 0  # drafted when the recovery step ran
        self._fault_at: float | None = None
        self._ended_at: float | None = None

    @property
    def seconds_after(self) -> float:
        """From the fault to the request's end."""
        return self._ended_at - self._fault_at

    async def run(self, fault, recovery=None) -> "FaultedRun":
        """Awaits fault(gen) once round FAULT_ROUND is out, so that the next round meets it, and recovery(gen), if
        given, two rounds later; raises what the request raises."""
        try:
            async for batch in self.gen.tokens():
                self.tokens.extend(batch)
                if self._fault_at is None and self.gen.stats.rounds == FAULT_ROUND:
                    self.tokens_before, self.draft_tokens_before = len(self.tokens), self.gen.stats.draft_tokens
                    await fault(self.gen)
                    self._fault_at = time.monotonic()
                elif recovery is not None and self.gen.stats.rounds == FAULT_ROUND + 2:
                    await recovery(self.gen)
                    self.draft_tokens_at_recovery = self.gen.stats.draft_tokens
        finally:
            self._ended_at = time.monotonic()
        assert self._fault_at is not None, "the request ended before the fault"
        return self


def at_once(action):
    """A fault that is one call on a link: stall, reset, resume."""
    async def fault(_gen: SpeculativeGeneration) -> None:
        action()
    return fault


# ---- a draft behind a link that stalls


async def test_a_stalled_draft_link_costs_one_draft_timeout_and_speculation_returns_after_resume(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as stack:
        # In flight: the round after the stall misses its draft deadline (DEADLINE_EXCEEDED), and the loop drops
        # the draft for the rest of the request.
        gen = stack.generation()
        faulted = await FaultedRun(gen).run(at_once(stack.draft_link.stall))
        assert faulted.tokens == greedy
        assert faulted.draft_tokens_before > 0 and gen.stats.draft_tokens == faulted.draft_tokens_before
        assert gen.stats.draft_fallback
        assert faulted.seconds_after < DRAFT_TIMEOUT_S + SLACK_S  # one draft deadline, not one a round
        # The pool's health checks (2 s deadline) cross the stalled link too: they find the replica down ...
        await eventually(lambda: stack.draft_replica.serving, False)
        # ... so a new request goes target-only at once, with no draft deadline to wait out.
        tokens, stats, seconds = await stack.generate()
        assert tokens == greedy and stats.draft_tokens == 0 and stats.draft_fallback
        assert seconds < DRAFT_TIMEOUT_S + SLACK_S

        # A request that met the draft down (UNAVAILABLE) asks again every few rounds: once the link is back
        # and the pool finds the replica serving, it speculates again within the request.
        async def resume(_gen):
            stack.draft_link.resume()
            await eventually(lambda: stack.draft_replica.serving)
        gen = stack.generation()
        resumed = await FaultedRun(gen).run(resume)
        assert resumed.draft_tokens_before == 0 and gen.stats.draft_tokens > 0
        assert resumed.tokens == greedy and gen.stats.draft_fallback
        # And new requests speculate from their first round.
        tokens, stats, _ = await stack.generate()
        assert tokens == greedy and stats.draft_tokens > 0 and not stats.draft_fallback


# ---- a draft behind a link that resets


async def test_a_reset_draft_link_changes_nothing_and_the_draft_serves_again(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as stack:
        # The session's round stream breaks (UNAVAILABLE): the pooled draft client drops the replica until a
        # health check passes, and the loop goes target-only meanwhile, asking again every few rounds. Once the
        # channel has connected again through the link and the replica passes its checks, the request drafts
        # there again: the replica still held the session, so it is closed and opened again from the request's
        # own record.
        async def draft_serving(_gen):
            await eventually(lambda: stack.draft_replica.serving)
        gen = stack.generation()
        faulted = await FaultedRun(gen).run(at_once(stack.draft_link.reset), recovery=draft_serving)
        assert faulted.tokens == greedy and faulted.draft_tokens_before > 0 and gen.stats.draft_fallback
        assert gen.stats.draft_tokens > faulted.draft_tokens_at_recovery  # speculating again within the request
        assert faulted.seconds_after < DRAFT_TIMEOUT_S + SLACK_S
        assert stack.draft_link.snapshot()["resets"] >= 1 and stack.backends.draft.failovers == 1
        tokens, stats, _ = await stack.generate()  # and for new requests from their first round
        assert tokens == greedy and stats.draft_tokens > 0 and not stats.draft_fallback


# ---- pipelined: a PreDraft stream on the stalled link


async def test_a_stalled_draft_link_under_pipelining_changes_nothing_and_does_not_hang(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, caplog):
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, pipeline="on") as stack:
        assert stack.backends.pipelined

        async def stall_under_a_predraft(gen: PipelinedGeneration) -> None:
            assert gen._ahead is not None, "the next round's PreDraft stream should be on the link"
            stack.draft_link.stall()
        gen = stack.generation(PipelinedGeneration)
        faulted = await FaultedRun(gen).run(stall_under_a_predraft)
        assert faulted.tokens == greedy and faulted.draft_tokens_before > 0 and gen.stats.draft_fallback
        # The round waits one draft timeout for its pre-drafted branch, and sends no fresh Propose to wait another.
        assert "no pre-drafted branch within the draft timeout" in caplog.text
        assert faulted.seconds_after < DRAFT_TIMEOUT_S + SLACK_S
        stack.draft_link.resume()
        await eventually(lambda: stack.draft_replica.serving)
        tokens, stats, _ = await stack.generate()  # pipelined too: the servicer's loop config says "on"
        assert tokens == greedy and stats.draft_tokens > 0


# ---- a target behind a link that resets or stalls, beside a second target


@pytest.mark.parametrize("round_calls", ["stream", "batch"])
async def test_a_reset_target_link_fails_the_session_over_or_loses_nothing(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, round_calls):
    """A session's round stream broken by the reset fails its next Verify: the session moves to the other
    target. A replica's batch stream broken between two rounds is opened again by the next batch, through the
    link, on the same replica, which still holds the session: nothing is lost, nothing moves."""
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, targets=2,
                            round_calls=round_calls) as stack:
        gen, lost = stack.generation(), []

        async def reset_the_sessions_target(gen):
            lost.append(placed(stack.backends.target, gen))
            stack.target_links[lost[0]].reset()
        faulted = await FaultedRun(gen).run(reset_the_sessions_target)
        assert faulted.tokens == greedy and gen.stats.draft_tokens > faulted.draft_tokens_before
        moved = round_calls == "stream"
        assert stack.backends.target.failovers == moved and (placed(stack.backends.target, gen) != lost[0]) == moved
        assert stack.target_links[lost[0]].snapshot()["resets"] >= 1
        assert faulted.seconds_after < TARGET_TIMEOUT_S + SLACK_S


async def test_a_reset_link_to_the_only_target_reopens_the_session_there(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, round_calls="stream") as stack:
        # The Verify finds the replica lost (UNAVAILABLE); the session waits for a healthy target, which is the
        # same one, back through the link and still holding the session: it is closed there and resumed from
        # the committed sequence (else the resume would fail the request with ALREADY_EXISTS).
        gen = stack.generation()
        faulted = await FaultedRun(gen).run(at_once(stack.target_links["target-ext-0"].reset))
        assert faulted.tokens == greedy and gen.stats.draft_tokens > faulted.draft_tokens_before
        assert stack.backends.target.failovers == 1 and placed(stack.backends.target, gen) == "target-ext-0"
        assert faulted.seconds_after < TARGET_TIMEOUT_S + SLACK_S


async def test_a_stalled_target_link_never_holds_a_request_past_its_verify_deadline(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, targets=2) as stack:
        gen, stalled = stack.generation(target_timeout_s=STALLED_VERIFY_TIMEOUT_S), []

        async def stall_the_sessions_target(gen):
            stalled.append(placed(stack.backends.target, gen))
            stack.target_links[stalled[0]].stall()
        faulted = await FaultedRun(gen).run(stall_the_sessions_target)
        # The health checks (2 s deadline) cross the stalled link too: once they have failed twice in a row,
        # the Verify waiting there fails over, not at its deadline: the session is re-prefilled on the other
        # target and the same round sent again, so the output is unchanged.
        (other,) = set(stack.target_links) - set(stalled)
        assert faulted.tokens == greedy and gen.stats.draft_tokens > faulted.draft_tokens_before
        assert stack.backends.target.failovers == 1 and placed(stack.backends.target, gen) == other
        assert faulted.seconds_after < STALLED_VERIFY_TIMEOUT_S + SLACK_S
        # The abandoned Verify was a part of a batch on the replica's stream: nothing waits for it there.
        assert stack.target_replica(stalled[0]).client.batches.parts_waiting == 0
        # New requests go to the other target.
        await eventually(lambda: stack.target_replica(stalled[0]).serving, False)
        placed_before = stack.target_replica(other).placed
        tokens, stats, _ = await stack.generate()
        assert tokens == greedy and stats.draft_tokens > 0
        assert stack.target_replica(other).placed == placed_before + 1


async def test_a_target_lost_while_it_decodes_ahead_fails_over_with_the_same_output(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    """Target-only rounds across a link decode ahead (a Verify commits several tokens); the link to the
    session's target stalls while such a Verify is on it: the session moves to the other target, which decodes
    the same tokens ahead from the committed sequence."""
    greedy = expected(tiny_llama_dir)
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir, targets=2) as stack:
        request = GenerationRequest(request_id="ahead", prompt_token_ids=stack.tokenizer.encode(PROMPT),
                                    max_tokens=MAX_TOKENS, sampling=GREEDY, stop=[], num_speculative_tokens=0,
                                    fixed_k=True)
        config = LoopConfig(num_speculative_tokens=0, decode_ahead=4, target_timeout_s=STALLED_VERIFY_TIMEOUT_S)
        gen = SpeculativeGeneration(request, stack.backends.target, None, stack.backends.eos_token_ids, config)
        tokens, batches, stalled, started = [], [], [], 0.0
        async for batch in gen.tokens():
            tokens.extend(batch)
            batches.append(len(batch))
            if not stalled and len(batch) > 1:  # a Verify decoded ahead: the next one will too, and meets the stall
                stalled.append((placed(stack.backends.target, gen), len(batches)))
                stack.target_links[stalled[0][0]].stall()
                started = time.monotonic()
        assert stalled, f"no target-only round decoded ahead over a {LINK.rtt_ms} ms link: {batches}"
        (lost, rounds_before), = stalled
        (other,) = set(stack.target_links) - {lost}
        assert tokens == greedy
        assert stack.backends.target.failovers == 1 and placed(stack.backends.target, gen) == other
        assert max(batches[rounds_before:]) > 1  # the round replayed on the other target decoded ahead as well
        assert time.monotonic() - started < STALLED_VERIFY_TIMEOUT_S + SLACK_S


# ---- sampled, seeded: a draft link reset


async def test_a_reset_draft_link_under_seeded_sampling_completes_the_request(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    async with linked_stack(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as stack:
        undisturbed = [t async for batch in stack.generation(sampling=SEEDED).tokens() for t in batch]
        gen = stack.generation(sampling=SEEDED)
        faulted = await FaultedRun(gen).run(at_once(stack.draft_link.reset))
        assert gen.stats.draft_fallback and faulted.draft_tokens_before > 0
        assert faulted.seconds_after < DRAFT_TIMEOUT_S + SLACK_S
        # It runs to its end: max_tokens, or an EOS.
        assert len(faulted.tokens) == MAX_TOKENS or faulted.tokens[-1] in stack.backends.eos_token_ids
        # Up to the fault it is the undisturbed request, token for token. Not after it: the target samples a
        # session's rounds from one seeded generator, and each round draws as many numbers as it verifies draft
        # tokens, so target-only rounds (and the draft's return after them) move every later draw, as a target
        # failover does (docs/design/pools-and-failover.md). The output keeps the target's distribution.
        assert faulted.tokens[:faulted.tokens_before] == undisturbed[:faulted.tokens_before]


# ---- scripted replicas: when a health check fails while a call waits


PROMPT_IDS = [1, 2, 3]
FIRST_TOKEN = 4
NO_ANSWER = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="no answer within the check's deadline")


class ScriptedHealth:
    """A replica's channel as the pool's health checks use it: with `scripted`, each check waits for the outcome
    the test puts in `outcomes` (a status, or an error to raise); else every check finds it SERVING at once."""

    def __init__(self, scripted: bool):
        self.scripted = scripted
        self.outcomes: asyncio.Queue = asyncio.Queue()

    def unary_unary(self, _method, **_options):
        return self._check

    unary_stream = unary_unary

    async def _check(self, _request, timeout=None):
        outcome = await self.outcomes.get() if self.scripted else health_pb2.HealthCheckResponse.SERVING
        if isinstance(outcome, Exception):
            raise outcome
        return health_pb2.HealthCheckResponse(status=outcome)

    async def close(self, grace=None):
        pass


class ScriptedTarget:
    """A target replica's client: a Verify waits until `answer` is set (at once with `answering`)."""

    def __init__(self, answering: bool):
        self.answer = asyncio.Event()
        if answering:
            self.answer.set()
        self.verifying = asyncio.Event()  # set when a Verify arrives
        self.calls: list[tuple] = []
        self.cancelled = 0  # Verifies cancelled while they waited

    async def model_info(self, timeout):
        return common_pb2.ModelInfo(model="scripted")

    async def open(self, request_id, prompt, sampling, timeout, max_new_tokens=0):
        self.calls.append(("open", list(prompt)))
        return target_pb2.TargetOpenResponse(token_id=FIRST_TOKEN)

    async def resume(self, request_id, committed, sampling, timeout, max_new_tokens=0):
        self.calls.append(("resume", list(committed)))
        return target_pb2.TargetOpenResponse()

    async def verify(self, request_id, round_number, position, draft_token_ids, distributions, timeout,
                     *_options):
        self.calls.append(("verify", round_number, position))
        self.verifying.set()
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.verifying.clear()
        return target_pb2.VerifyResponse(accepted_count=len(draft_token_ids), next_token_id=9)

    async def close(self, request_id):
        self.calls.append(("close",))


@dataclass
class ScriptedTargets:
    """Target replicas `a` (its checks and Verifies answer when the test says) and `b` (at once), in a pool."""

    pool: ReplicaPool
    health: dict[str, ScriptedHealth]
    clients: dict[str, ScriptedTarget]
    target: PooledTargetClient

    @classmethod
    async def start(cls) -> "ScriptedTargets":
        names = {"a": True, "b": False}  # scripted or not
        discover = fixed_replicas({name: f"scripted:{name}" for name in names})
        pool = ReplicaPool("target", discover, make_client=None)
        resolves = await discover()
        health = {name: ScriptedHealth(scripted) for name, scripted in names.items()}
        clients = {name: ScriptedTarget(answering=not scripted) for name, scripted in names.items()}
        for name in names:
            pool.replicas[name] = Replica(name, resolves[name], address=f"scripted:{name}", channel=health[name],
                                          client=clients[name], serving=True)
        scripted = cls(pool, health, clients, PooledTargetClient(pool))
        await scripted.target.open("s", PROMPT_IDS, GREEDY, timeout=WORK_TIMEOUT_S)
        assert scripted.placed == "a"  # equal loads: the first by name
        return scripted

    @property
    def a(self) -> Replica:
        return self.pool.replicas["a"]

    @property
    def placed(self) -> str:
        return self.target.sessions["s"].replica.name

    async def verifying(self, round_number: int = 1) -> asyncio.Future:
        """A Verify of the session's round, waiting on its replica."""
        verify = asyncio.ensure_future(self.target.verify("s", round_number, len(PROMPT_IDS) + 1, [7], [],
                                                          timeout=WORK_TIMEOUT_S))
        await self.clients[self.placed].verifying.wait()
        return verify

    async def check_a(self, outcome) -> None:
        """One health check of `a` that meets `outcome` (`b` passes its own)."""
        self.health["a"].outcomes.put_nowait(outcome)
        await self.pool.refresh()

    async def stop(self) -> None:
        await self.pool.stop()


@contextlib.asynccontextmanager
async def scripted_targets():
    scripted = await ScriptedTargets.start()
    try:
        yield scripted
    finally:
        await scripted.stop()


async def test_a_replica_that_misses_one_health_check_keeps_the_calls_in_flight_and_its_sessions():
    # A busy replica may miss a check (2 s deadline): no new sessions go there until it passes one, but its
    # calls in flight are not abandoned, so its sessions are not moved (each move re-prefills the session and
    # uses up one of its max_replica_failures).
    async with scripted_targets() as scripted:
        for round_number in (1, 2):  # failed checks count in a row only: a pass between two starts afresh
            verify = await scripted.verifying(round_number)
            await scripted.check_a(NO_ANSWER)
            assert not scripted.a.serving and scripted.a.failed_checks == 1 and not verify.done()
            scripted.clients["a"].answer.set()
            assert (await verify).next_token_id == 9
            scripted.clients["a"].answer.clear()
            # The pool checks a replica again at once after a miss: it passes.
            scripted.health["a"].outcomes.put_nowait(health_pb2.HealthCheckResponse.SERVING)
            await eventually(lambda: scripted.a.serving)
            assert scripted.a.failed_checks == 0
        assert scripted.target.failovers == 0 and scripted.placed == "a" and scripted.clients["a"].cancelled == 0
        assert scripted.clients["b"].calls == []


async def test_a_replica_that_fails_its_health_checks_in_a_row_fails_the_call_in_flight_over():
    async with scripted_targets() as scripted:
        verify = await scripted.verifying()
        await scripted.check_a(NO_ANSWER)
        assert not verify.done()
        scripted.health["a"].outcomes.put_nowait(NO_ANSWER)  # the re-check after the miss fails too
        verified = await asyncio.wait_for(verify, WORK_TIMEOUT_S)  # the scripted Verify on `a` never answers
        # The Verify on `a` was cancelled; the session was re-prefilled on `b` from what it had committed, and
        # the same round sent again there.
        assert verified.next_token_id == 9 and scripted.clients["a"].cancelled == 1
        assert scripted.target.failovers == 1 and scripted.placed == "b" and not scripted.a.calls
        assert scripted.clients["b"].calls == [("resume", [*PROMPT_IDS, FIRST_TOKEN]),
                                               ("verify", 1, len(PROMPT_IDS) + 1)]


@pytest.mark.parametrize("found_unreachable_too", [False, True], ids=["cancelled", "cancelled-and-unreachable"])
async def test_a_cancelled_request_is_cancelled_not_failed_over(found_unreachable_too):
    # The client went away: the call on the replica is cancelled, and the cancellation reaches the request,
    # also when the pool finds the replica unreachable at the same moment.
    async with scripted_targets() as scripted:
        verify = await scripted.verifying()
        verify.cancel()
        if found_unreachable_too:
            scripted.a.abandon_calls()
        with pytest.raises(asyncio.CancelledError):
            await verify
        assert scripted.clients["a"].cancelled == 1 and not scripted.a.calls
        assert scripted.target.failovers == 0 and scripted.placed == "a" and scripted.clients["b"].calls == []
