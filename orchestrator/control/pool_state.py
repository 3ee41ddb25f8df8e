"""A pool as the Admin service shows it (`specmesh replicas`): its size, its model, each replica's state."""

from __future__ import annotations

from orchestrator.control.rollout import Rollout
from orchestrator.serving.pool import ReplicaPool
from specmesh.v1 import admin_pb2, common_pb2


def pool_state(role: str, pool: ReplicaPool, controller=None, rollout: Rollout | None = None) -> admin_pb2.PoolState:
    """`controller`: the pool's LocalPoolController or PoolController, None where this orchestrator owns no
    replicas of it; `rollout`: the one under way, if any."""
    low, high = controller.spec.bounds if controller else (0, 0)
    if low >= high:
        low = high = 0  # not autoscaling
    desired = controller.desired if controller else len([r for r in pool.replicas.values() if not r.draining])
    state = admin_pb2.PoolState(pool=role, desired_replicas=desired, min_replicas=low, max_replicas=high,
                                model=controller.spec.replica.service.model if controller else "",
                                rollout=rollout.progress if rollout is not None else "")
    for replica in sorted(pool.replicas.values(), key=lambda r: r.name):
        draining = replica.draining or bool(controller and replica.name in controller.draining)
        supervised, retry_in_s = getattr(controller, "replica_state", _unsupervised)(replica.name)
        shown = ("draining" if draining else supervised or
                 ("starting" if replica.name in pool.withheld else replica.state))
        load, info = replica.load, replica.info or common_pb2.ModelInfo()
        state.replicas.add(name=replica.name, address=replica.address or "", state=shown,
                           open_sessions=replica.open_sessions, routed_sessions=replica.routed,
                           model=info.model, precision=info.precision, cpu_linear=info.cpu_linear,
                           load=load.score, kv_cache_usage=load.kv_cache_usage, has_room=load.has_room,
                           retry_in_s=retry_in_s)
    return state


def _unsupervised(name: str) -> tuple[None, float]:
    """Ray restarts its actors itself: the pool's checks are all there is to know of them."""
    return None, 0.0
