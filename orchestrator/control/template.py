"""Replica processes forked from a warm template, so that a start pays the fork, the model load and the server start.

A replica spawned as a fresh interpreter spends most of its start importing torch and transformers
(measured by benchmarks/replica_restart.py; the figures are in docs/results, not here: they are one host's). The
supervisor starts its replicas through multiprocessing's forkserver instead: one template process,
itself started from a fresh interpreter, imports the serving path (`PRELOAD`) and from then on only
forks, one child per replica start, first starts and restarts alike.

The template is safe to fork because of what it has not done: it imported modules and nothing
more. No gRPC channel, server or thread (gRPC does not survive a fork), no OpenMP region (libgomp's
thread pool), no CUDA, no model. Each replica sets its own CPU affinity and torch threads after the
fork (specmesh.server.service.load_engine) and gets the supervisor's environment of the moment
(`_run_forked`). What is read once at load (libgomp's GOMP_SPINCOUNT and OMP_*, the dynamic
loader's, torch's and transformers' settings: `LOAD_TIME_PREFIXES`) is the template's, so a replica
whose environment differs there (a draft's spin count: specmesh.loading.openmp) is spawned as before.

A replica forked from the template is the template's child: it dies with it (its parent-death
signal), and it watches the supervisor's end of its start-up pipe to die with the supervisor too.
The template is a moving part: one that dies is started again by multiprocessing at the next
start; one that fails a start (it died meanwhile, or did not fork within its timeout: then it is
killed) has that replica and the next starts for `RETRY_S` spawned, logged. Replicas on a GPU are
spawned until the template is checked there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
from multiprocessing import connection, forkserver
from typing import Callable

from specmesh.loading import openmp
from specmesh.roles import Role

log = logging.getLogger(__name__)

# What a replica imports before it serves: the supervisor (its run_replica: torch, transformers.modeling_utils,
# the services), the Auto classes and tokenizers that load a model, and the modeling code of the embedded models
# (Qwen2) and of the tests' and benchmarks' tiny ones (Llama). "__main__": the parent's main module, which a
# child imports as __mp_main__ (multiprocessing's default preload).
PRELOAD = ("__main__", "orchestrator.control.supervisor", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.generation.utils",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama")
# Environment variables read when a library loads (the template loaded them): a replica whose own differ is spawned.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "TORCH", "PYTORCH_", "CUDA_",
                      "HF_", "TRANSFORMERS_", "TOKENIZERS_")
# ...except those read each time they are used, which a forked replica gets from the supervisor's environment as
# any other: PYTHONBREAKPOINT (read at each breakpoint(); `ray.init` sets it in the process that calls it).
READ_WHEN_USED = frozenset({"PYTHONBREAKPOINT"})
FIRST_FORK_TIMEOUT_S = 300.0  # a new template imports PRELOAD before its first fork
FORK_TIMEOUT_S = 10.0  # a warm one forks in milliseconds
STOP_WAIT_S = 5.0  # for a killed template to exit; a SIGKILL takes effect in milliseconds
RETRY_S = 60.0  # after a failed start through the template, replicas are spawned for this long


def _load_time_settings(environment: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items()
            if name.startswith(LOAD_TIME_PREFIXES) and name not in READ_WHEN_USED}


def _differing(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    return sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))


class ReplicaTemplate:
    """Starts replica processes: forked from the template where it can serve them, else spawned.

    multiprocessing keeps one forkserver per process, so every ReplicaTemplate of a process shares it;
    one with another `preload` (a test's) replaces it, and the replicas forked from it, at its next start."""

    _preload: tuple[str, ...] | None = None  # of the template started last
    _settings: dict[str, str] | None = None  # its load-time settings, once it has forked a replica

    def __init__(self, preload: tuple[str, ...] = PRELOAD, fork_timeout_s: float = FORK_TIMEOUT_S,
                 first_fork_timeout_s: float = FIRST_FORK_TIMEOUT_S, retry_s: float = RETRY_S):
        self.preload = preload
        self.fork_timeout_s = fork_timeout_s  # also how long a warm template may take to report a replica's exit
        self.first_fork_timeout_s = first_fork_timeout_s
        self.retry_s = retry_s
        self.spawn_until = 0.0  # monotonic: until then replicas are spawned (the template failed a start)

    async def start(self, target: Callable, args: tuple, name: str, role: Role, device: str) -> mp.Process:
        """A started process running `target(*args)`; its start never waits longer than the fork timeout."""
        environment = dict(os.environ, **openmp.spin_environment(role))
        why_not = self._why_not(environment, device)
        if why_not is None:
            process = await self._fork(target, args, name, environment)
            if process is not None:
                return process
        else:
            log.info("%s spawned: %s", name, why_not)
        return spawn(target, args, name, role)

    def _why_not(self, environment: dict[str, str], device: str) -> str | None:
        if not device.startswith("cpu"):
            return f"a replica on {device} is not forked (not yet checked on a GPU)"
        if time.monotonic() < self.spawn_until:
            return "the replica template failed a start recently"
        differing = _differing(_load_time_settings(environment), self._template_settings())
        if differing:
            return f"its environment differs from the template's in settings read at load: {', '.join(differing)}"
        return None

    def _warm(self) -> bool:
        return ReplicaTemplate._preload == self.preload and ReplicaTemplate._settings is not None and template_alive()

    def _template_settings(self) -> dict[str, str]:
        """The load-time settings of the template this start goes through: the running one's, or the
        environment's now, which a new one starts with."""
        return ReplicaTemplate._settings if self._warm() else _load_time_settings(os.environ)

    async def _fork(self, target: Callable, args: tuple, name: str, environment: dict[str, str]) -> mp.Process | None:
        """The process forked from the template, or None (logged) where the template failed it."""
        if ReplicaTemplate._preload != self.preload:
            stop_template()
        settings, warm = self._template_settings(), self._warm()
        ReplicaTemplate._preload = self.preload
        mp.set_forkserver_preload(list(self.preload))
        process = mp.get_context("forkserver").Process(
            target=_run_forked, args=(environment, self.preload, target, *args), name=name, daemon=False)
        timeout_s = self.fork_timeout_s if warm else self.first_fork_timeout_s
        try:
            # A new template takes os.environ as it is now, here in the event loop's thread: a replica spawned
            # meanwhile changes it for its child (openmp.child_environment), never across this call.
            forkserver.ensure_running()
        except OSError as error:
            return self._failed(name, f"not started: {error}")
        starting = asyncio.ensure_future(asyncio.to_thread(process.start))
        try:
            await asyncio.wait_for(asyncio.shield(starting), timeout_s)
            ReplicaTemplate._settings = settings
            return process
        except asyncio.TimeoutError:
            why = f"no fork within {timeout_s:g} s: killed"
            stop_template()  # the start waiting on it ends with it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(starting, self.fork_timeout_s)
        except asyncio.CancelledError:  # the supervisor stops: what it was starting must not outlive it
            starting.add_done_callback(lambda done: done.exception() is None and process.kill())
            raise
        except Exception as error:  # noqa: BLE001 - it died, or never started: spawn this one
            why = f"{type(error).__name__}: {error}"
        return self._failed(name, why)

    def _failed(self, name: str, why: str) -> None:
        ReplicaTemplate._settings = None
        self.spawn_until = time.monotonic() + self.retry_s
        log.warning("the replica template failed to start %s (%s): spawning it, and replicas for the next %g s",
                    name, why, self.retry_s)

    async def wait_exit(self, process: mp.Process, pidfd: int | None, grace_s: float) -> None:
        """Until `process` has exited and its exit code is known. A forked replica's exit code comes from
        the template: one that dies reports 255 for a replica still running (which its parent-death signal
        stops; killed after `grace_s`), one that hangs reports nothing (killed after the fork timeout)."""
        if pidfd is None:
            await readable(process.sentinel)
            return
        await readable(process.sentinel, pidfd)
        if not _ready(process.sentinel):
            try:
                await asyncio.wait_for(readable(process.sentinel), self.fork_timeout_s)
            except asyncio.TimeoutError:
                log.warning("the replica template did not report the exit of %s (pid %d) within %g s: killed",
                            process.name, process.pid, self.fork_timeout_s)
                stop_template()
                await readable(process.sentinel)
        if not _ready(pidfd):
            try:
                await asyncio.wait_for(readable(pidfd), grace_s)
            except asyncio.TimeoutError:
                log.warning("%s (pid %d) still running %g s after its template died: killed", process.name,
                            process.pid, grace_s)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                await readable(pidfd)


TEMPLATE = ReplicaTemplate()  # the supervisor's


def spawn(target: Callable, args: tuple, name: str, role: Role) -> mp.Process:
    """A started process running `target(*args)` in a fresh interpreter, with the role's OpenMP settings."""
    process = mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=False)
    with openmp.child_environment(role):
        process.start()
    return process


def template_pid() -> int | None:
    """The running template's pid (None: none started); multiprocessing keeps it in its forkserver."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def template_alive() -> bool:
    pid = template_pid()
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # dead but not yet reaped: a zombie
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: not Linux
        return True


def stop_template() -> None:
    """Kill the template, if one runs (its replicas with it), and wait for its exit: multiprocessing starts another
    at the next start only once it finds this one exited (a start sent to one still dying would fail)."""
    pid = template_pid()
    ReplicaTemplate._settings = None
    if pid is None:
        return
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone already, or no pidfd (not Linux >= 5.3)
        pidfd = None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if pidfd is not None:
        try:
            select.select([pidfd], [], [], STOP_WAIT_S)  # SIGKILL: its exit takes milliseconds
        finally:
            os.close(pidfd)


async def readable(*fds: int) -> None:
    """Wait until one of `fds` is readable (data, EOF, or a process sentinel or pidfd: its exit)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    for fd in fds:
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        for fd in fds:
            loop.remove_reader(fd)


def _ready(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def forked(process: mp.Process) -> bool:
    return process._start_method == "forkserver"  # noqa: SLF001 - the context that started it


def open_pidfd(process: mp.Process) -> int | None:
    """A descriptor readable once the forked `process` has exited (None: not forked, or not Linux >= 5.3)."""
    if not forked(process):
        return None
    try:
        return os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        return None


def _run_forked(environment: dict[str, str], preload: tuple[str, ...], target: Callable, *args) -> None:
    """In a replica forked from the template: the supervisor's environment, a watch on the supervisor, then `target`."""
    os.environ.clear()
    os.environ.update(environment)
    missing = [name for name in preload if name != "__main__" and name not in sys.modules]
    if missing:
        log.warning("the replica template did not import %s: this replica imports it itself", ", ".join(missing))
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_die_with, args=(parent.sentinel,), name="supervisor-watch", daemon=True).start()
    target(*args)


def _die_with(sentinel: int) -> None:
    """SIGTERM to this process once the supervisor is gone (its parent-death signal is the template's)."""
    connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)
