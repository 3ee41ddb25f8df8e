"""Replicas forked from the warm template (orchestrator.control.template): real processes, real faults.

A replica killed mid-life comes back forked from the same template, which holds no thread (no gRPC,
no OpenMP pool); a template that dies takes its replicas down and a new one starts them; one that
hangs or whose preload fails costs a spawned start, never a hung supervisor; and a killed
supervisor leaves neither replica nor template behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import eventually
from orchestrator.control import template
from orchestrator.control.options import RestartPolicy
from orchestrator.control.supervisor import LocalReplica
from specmesh.roles import DRAFT, TARGET
from specmesh.server.service import ReplicaConfig, ServiceOptions

ROOT = Path(__file__).resolve().parent.parent
START_WAIT_S = 300.0  # a new template imports torch and transformers first: tens of seconds on a busy 2-core machine
POLICY = RestartPolicy(initial_backoff_s=0.05, max_restarts=10)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def exits_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` (any, not only a child) exits within `timeout_s`: its pidfd turns readable."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


def resume(pid: int) -> None:
    """SIGCONT to a template a test stopped, where the supervisor has not killed it, as it should have."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30.0)
        return response.status == health_pb2.HealthCheckResponse.SERVING


async def replaced(replica: LocalReplica, old_pid: int) -> str:
    """The address of the incarnation after `old_pid`'s."""
    await eventually(lambda: replica.process is not None and replica.process.pid not in (None, old_pid),
                     timeout_s=START_WAIT_S)
    return await asyncio.wait_for(replica.resolve(), START_WAIT_S)


@pytest.fixture
async def started(tiny_llama_dir):
    """A target replica pinned to core 0, started by the supervisor through `template` (default: the shared one)."""
    replicas = []

    async def start(through: template.ReplicaTemplate | None = template.TEMPLATE) -> LocalReplica:
        config = ReplicaConfig(TARGET.name, ServiceOptions(model=str(tiny_llama_dir), cpus=(0,)))
        replica = LocalReplica("target-0", config, POLICY, on_change=lambda: None, on_restart=lambda: None,
                               template=through)
        replicas.append(replica)
        replica.start()
        await asyncio.wait_for(replica.resolve(), START_WAIT_S)
        return replica
    yield start
    await asyncio.gather(*(replica.stop() for replica in replicas))


async def test_a_killed_replica_comes_back_forked_from_the_same_threadless_template(started):
    replica = await started()
    first, template_pid = replica.process.pid, template.template_pid()
    assert parent_of(first) == template_pid != os.getpid()
    assert os.listdir(f"/proc/{template_pid}/task") == [str(template_pid)]  # no gRPC, OpenMP or other thread
    assert os.sched_getaffinity(first) == {0}  # the replica pinned itself after the fork
    os.kill(first, signal.SIGKILL)
    address = await replaced(replica, first)
    assert parent_of(replica.process.pid) == template_pid and await serving(address)
    assert os.sched_getaffinity(replica.process.pid) == {0}


async def test_a_dead_template_takes_its_replicas_down_and_a_new_one_starts_them(started):
    replica = await started()
    first, old_template = replica.process.pid, template.template_pid()
    os.kill(old_template, signal.SIGKILL)
    address = await replaced(replica, first)
    assert exits_within(first, 0)  # gone before its replacement started: never two incarnations
    new_template = template.template_pid()
    assert new_template != old_template and parent_of(replica.process.pid) == new_template
    assert await serving(address)


async def test_a_template_that_reports_no_exit_is_killed_and_the_replica_restarts(started, caplog):
    replica = await started(template.ReplicaTemplate(fork_timeout_s=2.0))
    first, stopped = replica.process.pid, template.template_pid()
    os.kill(stopped, signal.SIGSTOP)  # alive, and reaps and reports nothing
    try:
        with caplog.at_level(logging.WARNING, logger=template.__name__):
            os.kill(first, signal.SIGKILL)
            address = await replaced(replica, first)
    finally:
        resume(stopped)
    assert "did not report the exit of specmesh-target-0" in caplog.text and exits_within(stopped, 10.0)
    assert parent_of(replica.process.pid) == template.template_pid() != stopped and await serving(address)


async def test_a_template_that_forks_no_replica_is_killed_and_the_replica_spawned(started, caplog):
    hanging = template.ReplicaTemplate(fork_timeout_s=2.0)
    await started(hanging)  # the template is up and has forked once
    stopped = template.template_pid()
    os.kill(stopped, signal.SIGSTOP)  # alive, and answers no fork
    try:
        with caplog.at_level(logging.WARNING, logger=template.__name__):
            replica = await started(hanging)
    finally:
        resume(stopped)
    assert "failed to start specmesh-target-0 (no fork within 2 s: killed)" in caplog.text
    assert exits_within(stopped, 10.0)
    assert parent_of(replica.process.pid) == os.getpid() and await serving(await replica.resolve())


async def test_a_preload_the_template_cannot_import_is_imported_by_the_replica(started, capfd):
    missing = template.ReplicaTemplate(preload=template.PRELOAD + ("specmesh_no_such_module",))
    replica = await started(missing)  # a new template: its output is this test's
    assert parent_of(replica.process.pid) == template.template_pid() and await serving(await replica.resolve())
    assert "the replica template did not import specmesh_no_such_module" in capfd.readouterr().err


async def test_a_template_whose_preload_fails_costs_a_spawned_start(started, caplog, tmp_path, monkeypatch):
    (tmp_path / "specmesh_failing_preload.py").write_text("raise RuntimeError('a preload that fails')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    failing = template.ReplicaTemplate(preload=template.PRELOAD + ("specmesh_failing_preload",))
    with caplog.at_level(logging.WARNING, logger=template.__name__):
        replica = await started(failing)
    assert "the replica template failed to start specmesh-target-0" in caplog.text
    assert parent_of(replica.process.pid) == os.getpid() and await serving(await replica.resolve())


def test_a_killed_supervisor_leaves_neither_replica_nor_template(tiny_llama_dir):
    script = f"""
import asyncio, os
from orchestrator.control import template
from orchestrator.control.options import RestartPolicy
from orchestrator.control.supervisor import LocalReplica
from specmesh.server.service import ReplicaConfig, ServiceOptions

async def main():
    replica = LocalReplica("target-0", ReplicaConfig("target", ServiceOptions(model={str(tiny_llama_dir)!r})),
                           RestartPolicy(), on_change=lambda: None, on_restart=lambda: None)
    replica.start()
    await replica.resolve()
    print(replica.process.pid, template.template_pid(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT)
    try:
        replica_pid, template_pid = map(int, supervisor.stdout.readline().split())
        assert parent_of(replica_pid) == template_pid
        supervisor.kill()
        assert exits_within(replica_pid, 60.0) and exits_within(template_pid, 60.0)
    finally:
        supervisor.kill()
        supervisor.wait()


@pytest.mark.unit
def test_what_the_template_does_not_start():
    """A GPU replica, and one whose settings read at load differ from the template's (a draft's spin)."""
    starter = template.ReplicaTemplate()
    environment = dict(os.environ)
    assert starter._why_not(environment, "cpu") is None  # a target's, on a CPU
    # Read when used, not at load: a supervisor that called ray.init (which sets it) still forks its replicas.
    assert starter._why_not(dict(environment, PYTHONBREAKPOINT="ray.util.rpdb._driver_set_trace"), "cpu") is None
    assert starter._why_not(environment, "cuda:0") is not None
    if "GOMP_SPINCOUNT" not in os.environ:
        why = starter._why_not(dict(environment, GOMP_SPINCOUNT=DRAFT.openmp_spin_count), "cpu")
        assert why is not None and why.endswith("read at load: GOMP_SPINCOUNT")  # it names what differs
    starter.spawn_until = float("inf")  # it failed a start
    assert starter._why_not(environment, "cpu") is not None
