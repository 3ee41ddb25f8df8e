"""How soon a target replica serves after its process starts: the start-up broken down, and its imports.

    python -m benchmarks.replica_restart                     # a tiny model built on the fly, 3 trials per way
    python -m benchmarks.replica_restart --model DIR --trials 5 --out restart.json
    python -m benchmarks.replica_restart --mode supervised   # only the kill-and-replace case, both starts

A replica is started the ways the serving path starts one:

- process: `python -m target_service --model M --port P`, as an operator or a pod runs it (the way
  benchmarks.serve_process.start_logged starts services: this repository on PYTHONPATH, unbuffered);
- supervised: a `specmesh serve` replica, started by orchestrator.control.supervisor.LocalReplica (run_replica),
  one replica forked from the warm template (orchestrator.control.template, "template") and one spawned
  as a fresh interpreter ("spawn", the way before the template), both running, killed in turn so that
  both ways see the same load. Each trial opens a session and a VerifyRounds stream on it, SIGKILLs the
  child once a round is answered (mid-stream), and times the supervisor's replacement from its process's
  start (/proc/PID/stat: the fork, or the spawn) on. A spawned child imports this module as its
  __mp_main__ (only the standard library at its top); under `specmesh serve` it imports
  orchestrator.cli.main instead, which the import-time report below measures too.

Marks, in seconds from the process's start (the spawn):
  first output   the first line the process writes (process mode)
  imports done   process mode: the first log record, which main() writes once its modules are imported
                 and its flags parsed (the no-internal-token warning; this benchmark passes no token);
                 supervised: run_replica's first log record ("its modules imported")
  loaded         specmesh.loading.models' "loaded MODEL" line: weights and tokenizer in memory
  calibrated     the "step costs" line: kernels chosen, KV budget sized, warm-up and step-cost table done
  heap frozen    specmesh.heap's gc.freeze line (a full collection of start-up's garbage first)
  serving        process: the "target listening on" line; supervised: the supervisor learns the port
  health SERVING the first gRPC health check that answers SERVING (polled every 10 ms from the spawn)
  first call     the first OpenSession answered (then the session is closed)

and, for the supervised case, kill -> spawn (the supervisor's restart backoff); also the CPU seconds the
replica's process used until its first call was answered ("CPU s used"), which other load on the machine
inflates far less than the wall times. It prints a table of
medians (and min/max) per way and writes every trial with --out as JSON, with the import-time report:
one more process-mode start under `python -X importtime` (PYTHONPROFILEIMPORTTIME), its 15 modules of
the largest cumulative import time and its import time by top-level package, and the same for the
modules a spawned `specmesh serve` child imports besides (orchestrator.cli.main and the supervisor).
The bar: a replaced replica serves within TARGET_S of its process's start on an idle machine of
this kind (2-core x86 VM); the table says how the run compares, and the JSON records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.serve_process import ROOT

# Only the standard library above: a supervised replica, a spawned child, imports this module as its
# __mp_main__ before it starts, and what it imports here would count as the replica's start-up.

TARGET_S = 5.0  # a replaced replica should serve again within 5 s of its process's start
START_TIMEOUT_S = 300.0
POLL_S = 0.01
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
LOG_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) target (?:(\d+) )?[A-Z]+ (.*)$")
# log message (its start) -> mark; the first record of each counts
MESSAGE_MARKS = {"loaded ": "loaded", "target step costs": "calibrated", "target: ": "heap frozen"}
HEAP_FROZEN = "start-up objects left out of garbage collection"
MARKS = ("first output", "imports done", "loaded", "calibrated", "heap frozen", "serving", "health SERVING",
         "first call")
IMPORTTIME = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")
# What a spawned `specmesh serve` child imports besides the replica's own modules: its parent's main module
# (multiprocessing's spawn runs it as __mp_main__) and the supervisor, whose run_replica it unpickles.
SPAWN_EXTRA = "import orchestrator.cli.main, orchestrator.control.supervisor"


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """benchmarks.serve_process.start_logged's environment: this repository first on the path, unbuffered."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                PYTHONUNBUFFERED="1", **(extra or {}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def record_time(line: str) -> tuple[float, int | None, str] | None:
    """(wall time, pid or None, message) of one of the services' log records; None for any other line."""
    match = LOG_RECORD.match(line)
    if match is None:
        return None
    wall = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
    return wall, int(match.group(3)) if match.group(3) else None, match.group(4)


def message_mark(message: str) -> str | None:
    for start, mark in MESSAGE_MARKS.items():
        if message.startswith(start) and (mark != "heap frozen" or HEAP_FROZEN in message):
            return mark
    return None


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds process `pid` has used so far, from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # stat's fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


def process_start_wall(pid: int) -> float | None:
    """When process `pid` started, as wall time (10 ms resolution), from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat's field 22: start time, ticks since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# ---- process mode: python -m target_service ------------------------------------------------------------


def channel_options() -> list[tuple[str, int]]:
    # A refused connection is retried within ms, not after gRPC's default backoff of a second and more.
    return [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
            ("grpc.max_reconnect_backoff_ms", 50)]


def wait_serving_sync(address: str, deadline: float) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return time.time()
            except grpc.RpcError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"{address} not SERVING within {START_TIMEOUT_S:.0f} s")


def first_call_sync(address: str) -> float:
    import grpc
    from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        stub.OpenSession(target_pb2.TargetOpenRequest(request_id="restart-bench", prompt_token_ids=PROMPT,
                                                      sampling=common_pb2.SamplingParams(), max_new_tokens=8),
                         timeout=60.0)
        answered = time.time()
        stub.CloseSession(common_pb2.CloseSessionRequest(request_id="restart-bench"), timeout=10.0)
        return answered


def start_process(model: str, log_path: Path, extra_env: dict[str, str] | None = None):
    """`python -m target_service` on a port of its own, its output timestamped line by line as it comes."""
    port = free_port()
    command = [sys.executable, "-m", "target_service", "--model", model, "--port", str(port)]
    lines: list[tuple[float, str]] = []
    spawned = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=child_environment(extra_env), cwd=ROOT)

    def read() -> None:
        with log_path.open("w") as log:
            for line in process.stdout:
                lines.append((time.time(), line))
                log.write(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return process, port, spawned, lines, reader


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_line(process: subprocess.Popen, lines: list[tuple[float, str]], text: str, deadline: float) -> None:
    while not any(text in line for _, line in lines):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "".join(line for _, line in lines[-30:])
            raise SystemExit(f"target_service stopped or timed out before {text!r}:\n{tail}")
        time.sleep(POLL_S)


def process_trial(model: str, log_path: Path) -> dict:
    process, port, spawned, lines, reader = start_process(model, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        healthy = wait_serving_sync(f"127.0.0.1:{port}", deadline)
        called = first_call_sync(f"127.0.0.1:{port}")
        cpu = cpu_seconds(process.pid)
        wait_line(process, lines, "target listening on", deadline)
    finally:
        stop_process(process)
        reader.join(timeout=10)
    marks = {"health SERVING": healthy - spawned, "first call": called - spawned}
    if lines:
        marks["first output"] = lines[0][0] - spawned
    for arrived, line in lines:
        parsed = record_time(line)
        if parsed is not None:
            marks.setdefault("imports done", arrived - spawned)
            mark = message_mark(parsed[2])
            if mark:
                marks.setdefault(mark, arrived - spawned)
        elif "target listening on" in line:
            marks.setdefault("serving", arrived - spawned)
    return {"way": "process", "marks": marks, "cpu_s_until_first_call": cpu}


# ---- supervised mode: a `specmesh serve` replica, SIGKILLed mid-stream and replaced ------------------------


async def wait_serving(address: str, deadline: float) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                response = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.time()
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(POLL_S)
    raise TimeoutError(f"{address} not SERVING within {START_TIMEOUT_S:.0f} s")


async def first_call(address: str, request_id: str) -> float:
    import grpc
    from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        await stub.OpenSession(target_pb2.TargetOpenRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(), max_new_tokens=8),
            timeout=60.0)
        answered = time.time()
        await stub.CloseSession(common_pb2.CloseSessionRequest(request_id=request_id), timeout=10.0)
        return answered


async def kill_mid_stream(address: str, pid: int, request_id: str) -> float:
    """Open a session and a VerifyRounds stream, have one round answered, SIGKILL `pid`; the kill's wall time."""
    import grpc
    from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        opened = await stub.OpenSession(target_pb2.TargetOpenRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(), max_new_tokens=32),
            timeout=60.0)
        stream = stub.VerifyRounds()
        await stream.write(target_pb2.VerifyRequest(request_id=request_id, round=1, position=opened.committed_length))
        await asyncio.wait_for(stream.read(), 60.0)  # a target-only round answered: the stream is mid-generation
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(stream.read(), 10.0)  # the stream breaks
        stream.cancel()
        return killed


async def supervised_trials(model: str, trials: int, starts: tuple[str, ...]) -> list[dict]:
    """`trials` kills of a replica per way of starting it (`starts`: "template", "spawn"), in turn."""
    from orchestrator.control.options import RestartPolicy
    from orchestrator.control.supervisor import LocalReplica
    from orchestrator.control.template import TEMPLATE
    from specmesh.roles import TARGET
    from specmesh.server.service import ReplicaConfig, ServiceOptions
    config = ReplicaConfig(TARGET.name, ServiceOptions(model=model))
    replicas = {start: LocalReplica(f"target-{start}", config, RestartPolicy(max_restarts=trials + 1),
                                    on_change=lambda: None, on_restart=lambda: None,
                                    template=TEMPLATE if start == "template" else None) for start in starts}
    results = []
    try:
        for replica in replicas.values():  # one at a time: each first start has the machine to itself
            replica.start()
            await asyncio.wait_for(replica.resolve(), START_TIMEOUT_S)
        for trial in range(trials):
            for start, replica in replicas.items():
                results.append(await replaced(replica, f"supervised ({start})", f"{start}-{trial}"))
    finally:
        await asyncio.gather(*(replica.stop() for replica in replicas.values()))
    return results


async def replaced(replica, way: str, trial: str) -> dict:
    """Kill `replica`'s process mid-stream; the marks of its replacement."""
    old_pid = replica.process.pid
    killed = await kill_mid_stream(await replica.resolve(), old_pid, f"restart-bench-kill-{trial}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while replica.process is None or replica.process.pid == old_pid or replica.process.pid is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the supervisor started no replacement")
        await asyncio.sleep(0.002)
    pid = replica.process.pid
    noticed = time.time()
    spawned = process_start_wall(pid) or noticed
    address = await asyncio.wait_for(replica.resolve(), START_TIMEOUT_S)
    serving = time.time()
    healthy = await wait_serving(address, deadline)
    called = await first_call(address, f"restart-bench-call-{trial}")
    return {"way": way, "pid": pid, "spawned": spawned, "kill to spawn": spawned - killed,
            "cpu_s_until_first_call": cpu_seconds(pid),
            "marks": {"serving": serving - spawned, "health SERVING": healthy - spawned, "first call": called - spawned}}


@contextlib.contextmanager
def stderr_to(path: Path):
    """File descriptor 2 (this process's and every child spawned meanwhile) into `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def add_log_marks(results: list[dict], log_path: Path) -> None:
    """The replacement children's own log records (they share this process's stderr) as marks."""
    records = [parsed for parsed in map(record_time, log_path.read_text(errors="replace").splitlines()) if parsed]
    for result in results:
        marks = result["marks"]
        for wall, pid, message in records:
            if pid != result["pid"]:
                continue
            marks.setdefault("imports done", wall - result["spawned"])
            mark = message_mark(message)
            if mark:
                marks.setdefault(mark, wall - result["spawned"])


def run_supervised(model: str, trials: int, starts: tuple[str, ...], log_path: Path) -> list[dict]:
    with stderr_to(log_path):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s bench %(levelname)s %(message)s", force=True)
        results = asyncio.run(supervised_trials(model, trials, starts))
    add_log_marks(results, log_path)
    return results


# ---- import time ---------------------------------------------------------------------------------------


def importtime_rows(text: str) -> list[tuple[str, int, int, int]]:
    """(module, self us, cumulative us, depth) of each line of `-X importtime` output."""
    rows = []
    for line in text.splitlines():
        match = IMPORTTIME.match(line)
        if match:
            rows.append((match.group(4), int(match.group(1)), int(match.group(2)), len(match.group(3)) // 2))
    return rows


def importtime_report(rows: list[tuple[str, int, int, int]], top: int = 15, by: str = "cumulative") -> dict:
    """The `top` modules by cumulative (or, for a subset of a run's modules, self) time, and self time by package."""
    by_package = collections.Counter()
    for module, self_us, _, _ in rows:
        by_package[module.split(".")[0]] += self_us
    return {"modules": len(rows), "total_s": sum(row[1] for row in rows) / 1e6,
            "top_by": by,
            "top": [{"module": module, "cumulative_s": cumulative / 1e6, "self_s": self_us / 1e6, "depth": depth}
                    for module, self_us, cumulative, depth in
                    sorted(rows, key=lambda r: -r[2] if by == "cumulative" else -r[1])[:top]],
            "by_package": [{"package": package, "self_s": us / 1e6} for package, us in by_package.most_common(top)]}


def replica_importtime(model: str, log_path: Path) -> dict:
    """Every import of one process-mode start until it serves, under PYTHONPROFILEIMPORTTIME (its own start)."""
    process, port, _, lines, reader = start_process(model, log_path, {"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        wait_line(process, lines, "target listening on", time.monotonic() + START_TIMEOUT_S)
    finally:
        stop_process(process)
        reader.join(timeout=10)
    rows = importtime_rows("".join(line for _, line in lines))
    report = importtime_report(rows)
    report["command"] = "PYTHONPROFILEIMPORTTIME=1 python -m target_service --model M --port P (until serving)"
    report["module_names"] = sorted(row[0] for row in rows)
    return report


def spawn_extra_importtime(replica_modules: set[str]) -> dict:
    """What a `specmesh serve` child imports besides the replica's own modules: the serve CLI (its __mp_main__)
    and the supervisor, less every module `replica_modules` (a process-mode start's) holds."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", SPAWN_EXTRA], capture_output=True, text=True,
                          env=child_environment(), cwd=ROOT, check=True)
    # By self time: a module's cumulative time counts the replica's own modules it imports.
    report = importtime_report([row for row in importtime_rows(done.stderr) if row[0] not in replica_modules],
                               by="self")
    report["command"] = f"python -X importtime -c {SPAWN_EXTRA!r}, less the modules of the replica's start"
    return report


# ---- the report ----------------------------------------------------------------------------------------


def tiny_model(root: Path) -> str:
    from benchmarks.tiny_models import TINY_CORPUS, build_tiny_model, build_tokenizer
    return str(build_tiny_model(root / "target", "llama", build_tokenizer(root / "tokenizer", corpus=TINY_CORPUS),
                                seed=1))


def summary(results: list[dict]) -> dict[str, dict[str, float]]:
    table = {}
    for mark in ("kill to spawn",) + MARKS:
        values = [r.get(mark) if mark == "kill to spawn" else r["marks"].get(mark) for r in results]
        values = [v for v in values if v is not None]
        if values:
            table[mark] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    cpu = [r["cpu_s_until_first_call"] for r in results if r.get("cpu_s_until_first_call") is not None]
    if cpu:  # less sensitive than wall time to what else the machine runs
        table["CPU s used"] = {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)}
    return table


def print_table(way: str, table: dict[str, dict[str, float]]) -> None:
    print(f"\n{way}: seconds from the process's start (median, min-max)")
    for mark, value in table.items():
        print(f"  {mark:<15} {value['median']:7.2f}  ({value['min']:.2f}-{value['max']:.2f})")
    if "first call" in table:
        verdict = "within" if table["first call"]["median"] <= TARGET_S else "over"
        print(f"  -> first call {verdict} the {TARGET_S:g} s bar")


def print_importtime(title: str, report: dict) -> None:
    print(f"\n{title}: {report['modules']} modules, {report['total_s']:.2f} s of import time "
          f"(self times summed; -X importtime's own overhead included)\n  {report['command']}")
    print(f"  top by {report['top_by']} time:")
    for row in report["top"]:
        print(f"    {row[report['top_by'] + '_s']:6.2f} s  {'  ' * row['depth']}{row['module']}")
    print("  by top-level package (self time): " + ", ".join(
        f"{row['package']} {row['self_s']:.2f}" for row in report["by_package"]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target model (default: a tiny random Llama built in a "
                                                      "temporary directory)")
    parser.add_argument("--trials", type=int, default=3, help="starts per way (default: %(default)s)")
    parser.add_argument("--mode", choices=["both", "process", "supervised"], default="both")
    parser.add_argument("--start", choices=["both", "template", "spawn"], default="both",
                        help="how the supervised replica is started: forked from the warm template, spawned, "
                             "or one of each, killed in turn (default)")
    parser.add_argument("--no-importtime", action="store_true", help="skip the import-time report")
    parser.add_argument("--out", type=Path, default=None, help="write every trial and the report as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="replica-restart-") as work:
        work = Path(work)
        model = args.model or tiny_model(work)
        report = {"model": model, "target_s": TARGET_S, "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_average_before": os.getloadavg()}, "trials": []}
        if args.mode in ("both", "process"):
            for trial in range(args.trials):
                report["trials"].append(process_trial(model, work / f"process-{trial}.log"))
        if args.mode in ("both", "supervised"):
            starts = ("template", "spawn") if args.start == "both" else (args.start,)
            report["trials"] += run_supervised(model, args.trials, starts, work / "supervised.log")
        ways = dict.fromkeys(r["way"] for r in report["trials"])
        report["summary"] = {way: summary([r for r in report["trials"] if r["way"] == way]) for way in ways}
        if not args.no_importtime:
            replica = replica_importtime(model, work / "importtime.log")
            report["importtime"] = {"replica": replica,
                                    "spawn_extra": spawn_extra_importtime(set(replica["module_names"]))}
        report["machine"]["load_average_after"] = os.getloadavg()
    for way, table in report["summary"].items():
        print_table(way, table)
    if "importtime" in report:
        print_importtime("replica start, imports", report["importtime"]["replica"])
        print_importtime("a spawned `specmesh serve` child, besides", report["importtime"]["spawn_extra"])
    print(f"\nload average before {report['machine']['load_average_before']}, "
          f"after {report['machine']['load_average_after']} ({report['machine']['cpus']} CPUs)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
