"""The local supervisor's restart schedule: fast restarts up to the cap, then a crash loop that never ends.

No child processes: a replica's `_restart_delay` is what its supervising task calls after each
death, so the tests call it directly with how long the incarnation ran.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.control.options import RestartPolicy, doubling
from orchestrator.control.supervisor import LocalReplica
from specmesh.server.service import ReplicaConfig, ServiceOptions

pytestmark = pytest.mark.unit

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, max_restarts=3, window_s=60.0,
                       crash_loop_backoff_s=10.0, max_crash_loop_backoff_s=40.0)


def test_doubling_starts_at_the_base_and_stops_at_the_cap():
    assert [doubling(0.2, 1.0, attempt) for attempt in range(1, 6)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert doubling(0.2, 1.0, 0) == 0.2  # no attempt yet counts as the first


def test_the_crash_loop_backoff_doubles_from_its_own_base_to_its_own_cap():
    assert [POLICY.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert [POLICY.crash_loop_backoff(n) for n in range(1, 5)] == [10.0, 20.0, 40.0, 40.0]


async def test_past_the_cap_a_replica_crash_loops_reports_it_and_is_never_given_up():
    changes = []
    replica = LocalReplica("draft-0", ReplicaConfig("draft", ServiceOptions(model="unused")), POLICY,
                           on_change=lambda: changes.append(replica.state), on_restart=lambda: None)
    replica.process = SimpleNamespace(exitcode=-9)  # what the delay's log line reads
    assert [replica._restart_delay(ran_s=1.0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert replica.state is None and changes == []  # restarting within the cap: nothing to report
    assert [replica._restart_delay(ran_s=1.0) for _ in range(4)] == [10.0, 20.0, 40.0, 40.0]
    assert replica.state == "backoff" and not replica.gone and replica.retry_at is not None
    assert changes == ["backoff"] * 4  # each death past the cap, with the next retry's time


async def test_a_replica_that_ran_a_whole_window_leaves_its_crash_loop():
    replica = LocalReplica("target-0", ReplicaConfig("target", ServiceOptions(model="unused")), POLICY,
                           on_change=lambda: None, on_restart=lambda: None)
    replica.process = SimpleNamespace(exitcode=-9)
    for _ in range(5):
        replica._restart_delay(ran_s=1.0)
    assert replica.crash_loops == 2
    replica.restarts.clear()  # the earlier deaths have left the window, as they would have in 60 s
    assert replica._restart_delay(ran_s=POLICY.window_s) == POLICY.initial_backoff_s
    assert replica.crash_loops == 0
