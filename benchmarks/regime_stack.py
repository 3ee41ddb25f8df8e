"""A served stack in the emulated GPU regime, with emulated network links between its services: one command.

    python -m benchmarks.regime_stack --work /tmp/regime --profile h100-8b --alpha 0.8 \\
        --placement beside-target --rtt-ms 5 --bandwidth 1gbit

Emulated, not measured on a GPU: the set-acceptance pair (benchmarks/set_acceptance_pair.py) padded to a
profile's GPU step times (benchmarks/gpu_profiles.py), built once under WORK. Then, each a process of its own
as on separate machines:

- the target and the draft services (`python -m target_service`, `python -m draft_service`), holding one
  internal token; one compute thread each, as their tiny real forwards run fastest that way;
- the link (benchmarks.links): a delay line with the round trip and bandwidth of the placement in front of
  the service across the network: `beside-target` puts the orchestrator on the target's host (it reaches
  the target directly and the draft through the link), `beside-draft` the other way round, `direct` has no
  link at all (every service on one host, the stack users get without a network);
- `specmesh serve` attached to the two services, one of them through the link (`target-endpoints`, `draft-endpoints`,
  `internal-token-file`), pipelining on: the emulated draft and target are separate GPUs, where `auto`
  turns it on; the suffix index and prompt lookup off (`DRAFT_MODEL_ONLY`), as in the benchmarks.

It prints the client endpoint and runs until Ctrl-C. `RegimeStack` is the same for benchmarks, which change
the links' delay and bandwidth while the stack runs (`set_links`) and read the bytes they carried. With no link
(`direct`) it may hold several services of a role (`targets`, `drafts`: benchmarks/scale.py), all attached to
the one orchestrator, and restart the orchestrator alone with other settings (`restart_serve`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks.links import CONTROL_DONE, parse_counters_line
from benchmarks.serve_process import METRICS, READY, serve_command, start_logged, stop_serve

PLACEMENTS = ("direct", "beside-target", "beside-draft")
ROLES = ("target", "draft")
SERVICE_READY = re.compile(r"listening on ([^\s,]+), metrics http://[^\s:]+:(\d+)/metrics")
CONTROL_WAIT_S = 10.0


def delayed_link(placement: str) -> str | None:
    """The role whose link carries the placement's delay (None: no links)."""
    return {"direct": None, "beside-target": "draft", "beside-draft": "target"}[placement]


def ensure_pair(work: Path, profile: str, alphas: list[float], time_scale: float = 1.0) -> dict[str, Path]:
    """The emulated pair under WORK/<profile>-x<scale>, built once (a marker file holds what it was built with)."""
    from benchmarks.set_acceptance_pair import build_pair  # torch and transformers only where a pair is built

    dest = work / f"{profile}-x{time_scale:g}"
    # The pair's directories hold a copy of the modeling code: a pair built with other code is built again.
    code = hashlib.sha256(Path(__file__).with_name("modeling_set_acceptance.py").read_bytes()).hexdigest()
    marker, wanted = dest / "built.json", {"profile": profile, "alphas": sorted(alphas), "time_scale": time_scale,
                                           "modeling": code}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return {"target": dest / "target", **{f"draft-{a:g}": dest / f"draft-{a:g}" for a in alphas}}
    shutil.rmtree(dest, ignore_errors=True)  # built for other alphas, or cut short
    pair = build_pair(dest, sorted(alphas), small=True, profile=profile, time_scale=time_scale)
    marker.write_text(json.dumps(wanted))
    return pair


def service_names(role: str, count: int) -> list[str]:
    """A role's services: the first named as the role (a one-pair stack's names), the others numbered from 2."""
    return [role if i == 0 else f"{role}-{i + 1}" for i in range(count)]


@dataclass
class Service:
    process: subprocess.Popen
    address: str
    metrics_url: str


# The emulated pair's outputs are a hash walk in which unrelated prompts can merge: the suffix index and prompt
# lookup would find repeats no real workload has. The regime measures the draft model.
DRAFT_MODEL_ONLY = {"suffix-index": False, "prompt-lookup": False}


@dataclass
class RegimeStack:
    """The services, the links and the orchestrator of one (pair, draft, placement); `start()` then `stop()`."""

    target_dir: Path
    draft_dir: Path
    placement: str
    work: Path
    serve_settings: dict = field(default_factory=dict)  # more `specmesh serve` config keys
    targets: int = 1  # services of each role, attached to the one orchestrator; above 1 only `direct`
    drafts: int = 1
    services: dict[str, Service] = field(default_factory=dict)  # "target", "target-2", ..., "draft", ...
    links: subprocess.Popen | None = None
    _addresses: dict[str, list[str]] = field(default_factory=dict, init=False)  # by role, what serve attaches to
    serve: subprocess.Popen | None = None
    endpoint: str = ""  # the orchestrator's gRPC port
    metrics_url: str = ""  # the orchestrator's /metrics

    def start(self) -> "RegimeStack":
        linked = delayed_link(self.placement)
        if linked is not None and (self.targets, self.drafts) != (1, 1):
            raise ValueError("a link stands in front of one service: several of a role only `direct`")
        self.work.mkdir(parents=True, exist_ok=True)
        token = self._token_file
        token.write_text(secrets.token_urlsafe(32))
        token.chmod(0o600)
        try:
            for role, model in zip(ROLES, (self.target_dir, self.draft_dir)):
                for name in self.names(role):
                    self.services[name] = self._start_service(role, model, token, name)
            addresses = {role: [self.services[name].address for name in self.names(role)] for role in ROLES}
            if linked is not None:
                addresses[linked] = [self._start_link(linked)]
            self._addresses = addresses
            self._start_serve()
        except BaseException:
            self.stop()
            raise
        return self

    def names(self, role: str) -> list[str]:
        """The role's services, by name."""
        return service_names(role, self.targets if role == "target" else self.drafts)

    def metrics_urls(self, role: str) -> list[str]:
        return [self.services[name].metrics_url for name in self.names(role)]

    def restart_serve(self, settings: dict) -> None:
        """The orchestrator stopped and started again, attached to the same services, with these config keys over
        the stack's: what a setting costs is measured on the same services."""
        stop_serve(self.serve)
        self.serve, self.serve_settings = None, settings
        self._start_serve()

    def _start_service(self, role: str, model: Path, token: Path, name: str) -> Service:
        command = [sys.executable, "-m", f"{role}_service", "--model", str(model), "--trust-remote-code",
                   "--port", "0", "--metrics-port", "0", "--internal-token-file", str(token),
                   "--trace-exporter", "none"]
        process, found = start_logged(command, self.work / f"{name}.log", {"ready": SERVICE_READY},
                                      env={"OMP_NUM_THREADS": "1"})  # one compute thread each
        address, metrics_port = found["ready"].group(1), found["ready"].group(2)
        return Service(process, address, f"http://127.0.0.1:{metrics_port}/metrics")

    def _start_link(self, role: str) -> str:
        """A delay line in front of `role`'s service, at no delay until `set_links`; its listening address.
        The other role is reached directly: beside the orchestrator its messages cross no network."""
        command = [sys.executable, "-m", "benchmarks.links", "--control", str(self._control_file),
                   "--link", f"{role}=127.0.0.1:0,{self.services[role].address},0,unlimited"]
        pattern = re.compile(rf"^link ready: (\S+) .* name {role}$", re.M)
        self.links, found = start_logged(command, self.work / "links.log", {role: pattern}, timeout_s=60.0)
        return found[role].group(1)

    def _start_serve(self) -> None:
        addresses = self._addresses
        config = {"target": str(self.target_dir), "draft": str(self.draft_dir), "trust-remote-code": True,
                  "target-endpoints": addresses["target"], "draft-endpoints": addresses["draft"],
                  "internal-token-file": str(self._token_file), "port": 0, "http-port": -1, "metrics-port": 0,
                  "pipeline": "on", "trace-exporter": "none", **self.serve_settings}
        config_file = self.work / "serve.yaml"
        config_file.write_text(yaml.safe_dump(config))
        self.serve, found = start_logged(serve_command("--config", str(config_file)), self.work / "serve.log",
                                         {"grpc": READY, "metrics": METRICS})
        self.endpoint = f"127.0.0.1:{found['grpc'].group(1)}"
        self.metrics_url = f"http://127.0.0.1:{found['metrics'].group(1)}/metrics"

    @property
    def _control_file(self) -> Path:
        return self.work / "links.json"

    @property
    def _token_file(self) -> Path:
        return self.work / "internal-token"

    def set_links(self, rtt_ms: float, bandwidth: str) -> dict[str, dict]:
        """The placement's link at this round trip and bandwidth; its counters so far, by role ({} without)."""
        if self.links is None:
            return {}
        self._control_file.write_text(json.dumps({delayed_link(self.placement): {"rtt_ms": rtt_ms,
                                                                                  "bandwidth": bandwidth}}))
        return self._signal_links(signal.SIGHUP)

    def link_counters(self) -> dict[str, dict]:
        """Every link's counters so far, by role, leaving the links as they are."""
        return self._signal_links(signal.SIGHUP) if self.links is not None else {}

    def _signal_links(self, signum: int) -> dict[str, dict]:
        log = self.work / "links.log"
        seen = log.read_text().count(CONTROL_DONE)
        self.links.send_signal(signum)
        deadline = time.monotonic() + CONTROL_WAIT_S
        while log.read_text().count(CONTROL_DONE) <= seen:
            if time.monotonic() > deadline or self.links.poll() is not None:
                raise RuntimeError(f"the links did not answer a control signal: {log.read_text()[-2000:]}")
            time.sleep(0.02)  # paces reading another process's log
        last = log.read_text().rsplit(CONTROL_DONE, 2)[-2]  # the lines this signal printed
        counters = [parse_counters_line(line) for line in last.splitlines()]
        return {entry["name"]: entry for entry in counters if entry is not None}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time each process of the stack has used so far (user + system), by name: what a round costs the
        host besides the emulated steps (which sleep)."""
        processes = {"orchestrator": self.serve, "links": self.links,
                     **{name: service.process for name, service in self.services.items()}}
        return {name: process_cpu_seconds(process.pid) for name, process in processes.items()
                if process is not None and process.poll() is None}

    def stop(self) -> None:
        for process in (self.serve, self.links, *(s.process for s in self.services.values())):
            if process is not None:
                stop_serve(process)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regime_stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specmesh-regime"), help="pair, logs, config")
    parser.add_argument("--profile", default="h100-8b", help="benchmarks/gpu_profiles.py's name")
    parser.add_argument("--alpha", type=float, default=0.8, help="the draft's set acceptance")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the profile's times multiplied by this")
    parser.add_argument("--placement", choices=PLACEMENTS, default="beside-target")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="the delayed link's round trip")
    parser.add_argument("--bandwidth", default="unlimited", help="the delayed link's: 1gbit, 10gbit, unlimited")
    args = parser.parse_args(argv)
    pair = ensure_pair(args.work, args.profile, [args.alpha], args.time_scale)
    stack = RegimeStack(pair["target"], pair[f"draft-{args.alpha:g}"], args.placement,
                        args.work / f"stack-{args.placement}", DRAFT_MODEL_ONLY).start()
    try:
        stack.set_links(args.rtt_ms * args.time_scale, args.bandwidth)
        print(f"regime stack ready (emulated {args.profile}, alpha {args.alpha:g}, {args.placement}, rtt "
              f"{args.rtt_ms:g} ms, {args.bandwidth}): client endpoint {stack.endpoint}, metrics "
              f"{stack.metrics_url}", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
