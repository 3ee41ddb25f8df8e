"""The loop's clients are typed by a Protocol that the single and the pooled clients both satisfy.

runtime_checkable only sees that a method exists; the check here compares each method's
signature with the Protocol's (parameter names, kinds and defaults; async or not), so a
client that grows, renames or reorders a parameter the loop passes fails here, not mid-request.
"""

from __future__ import annotations

import inspect

import grpc
import pytest

from orchestrator.decoding.endpoints import BranchStream, DraftEndpoint, TargetEndpoint
from orchestrator.serving.clients import DraftClient, TargetClient
from orchestrator.serving.failover import PooledDraftClient, PooledTargetClient, _NoBranches

pytestmark = pytest.mark.unit


def protocol_methods(protocol: type) -> list[str]:
    return sorted(name for name, member in vars(protocol).items()
                  if inspect.isfunction(member) and not name.startswith("_"))


def mismatches(protocol: type, cls: type) -> list[str]:
    """How cls's methods differ from protocol's: missing, sync against async, or another signature."""
    found = []
    for name in protocol_methods(protocol):
        wanted, method = getattr(protocol, name), getattr(cls, name, None)
        if method is None:
            found.append(f"{name}: missing")
        elif inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(method):
            found.append(f"{name}: async on one side only")
        elif _parameters(wanted) != _parameters(method):
            found.append(f"{name}{inspect.signature(method)} is not {name}{inspect.signature(wanted)}")
    return found


def _parameters(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls", [DraftClient, PooledDraftClient])
def test_draft_clients_are_draft_endpoints(cls):
    assert issubclass(cls, DraftEndpoint)
    assert mismatches(DraftEndpoint, cls) == []


@pytest.mark.parametrize("cls", [TargetClient, PooledTargetClient])
def test_target_clients_are_target_endpoints(cls):
    assert issubclass(cls, TargetEndpoint)
    assert mismatches(TargetEndpoint, cls) == []


def test_the_protocols_name_what_the_loop_calls():
    assert protocol_methods(DraftEndpoint) == ["close", "open", "predraft", "propose"]
    assert protocol_methods(TargetEndpoint) == ["close", "open", "verify"]


@pytest.mark.parametrize("cls", [grpc.aio.UnaryStreamCall, _NoBranches])
def test_both_kinds_of_predraft_stream_are_branch_streams(cls):
    assert issubclass(cls, BranchStream)


class _Renamed:
    async def open(self, request_id, prompt, sampling, timeout, max_new_tokens=0): ...

    async def propose(self, request_id, round_number, commit, position, count, timeout): ...

    def predraft(self, request_id, round_number, commit, position, assumed_token_ids, num_tokens,
                 extra_branches, timeout): ...

    def close(self, request_id): ...


def test_the_check_catches_a_renamed_parameter_and_a_lost_async():
    assert [problem.split("(")[0].split(":")[0] for problem in mismatches(DraftEndpoint, _Renamed)] == [
        "close", "propose"]
    assert "verify: missing" in mismatches(TargetEndpoint, _Renamed)
