"""Two network namespaces joined by a veth pair, bandwidth-limited by `tc tbf` (root only).

An alternative to the user-space delay line (benchmarks/links.py) for bandwidth: the kernel shapes
the traffic, with real TCP behaviour (congestion control, segment sizes) on the link. A kernel
without the netem qdisc cannot add delay this way; run a `DelayLine` inside one namespace for the
rtt (`ip netns exec NS python -m benchmarks.links ...`).

    if netns_available():
        with NamespacePair(bandwidth_bps=1e9) as pair:
            server = subprocess.Popen(pair.exec_args("b", ["python", "server.py", pair.address_b]))
            client = subprocess.Popen(pair.exec_args("a", ["python", "client.py", pair.address_b]))

Each end of the veth gets `tc qdisc add dev X root tbf rate R burst B latency 50ms`, so both
directions are limited to R; B is one millisecond of R (32 kbit at least), which lets a tbf keep up
with gigabit rates. Namespace and device names carry the process id, so that concurrent runs on one
host do not collide; leaving the context deletes both namespaces, and the veth pair with them.

tbf counts headers too: a connection's payload rate is somewhat below the rate set.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

from benchmarks.links import format_bandwidth

TBF_LATENCY = "50ms"
MIN_BURST_BYTES = 4000  # 32 kbit
_instances = itertools.count()


def netns_available() -> bool:
    """Whether this process may create namespaces: root, with a working `ip netns` and `tc`."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def tbf_arguments(bandwidth_bps: float) -> list[str]:
    """The tbf qdisc's parameters for a rate, with a burst of about one millisecond of it."""
    burst_bytes = max(MIN_BURST_BYTES, int(bandwidth_bps / 8 / 1000))
    # tc reads a size without unit as bytes (and has no plain "bit" unit for sizes).
    return ["tbf", "rate", f"{int(bandwidth_bps)}bit", "burst", str(burst_bytes), "latency", TBF_LATENCY]


class NamespacePair:
    """Namespaces "a" and "b", one veth between them (a: 10.231.0.1, b: 10.231.0.2), tbf on both ends."""

    def __init__(self, bandwidth_bps: float | None = None) -> None:
        instance = next(_instances)
        tag = f"{os.getpid() % 100000}x{instance}"
        self.bandwidth_bps = bandwidth_bps
        self.namespaces = {"a": f"specmesh-{tag}-a", "b": f"specmesh-{tag}-b"}
        self.devices = {"a": f"sm{tag}a", "b": f"sm{tag}b"}  # at most 15 characters
        # Addresses are private to the pair's namespaces, so every pair can use the same ones.
        self.addresses = {"a": "10.231.0.1", "b": "10.231.0.2"}

    @property
    def address_a(self) -> str:
        return self.addresses["a"]

    @property
    def address_b(self) -> str:
        return self.addresses["b"]

    def exec_args(self, side: str, argv: list[str]) -> list[str]:
        """`argv` to run inside namespace `side` ("a" or "b")."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def __enter__(self) -> NamespacePair:
        try:
            self._create()
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._delete()

    def _create(self) -> None:
        for side in ("a", "b"):
            _run("ip", "netns", "add", self.namespaces[side])
        _run("ip", "link", "add", self.devices["a"], "type", "veth", "peer", "name", self.devices["b"])
        for side in ("a", "b"):
            namespace, device = self.namespaces[side], self.devices[side]
            _run("ip", "link", "set", device, "netns", namespace)
            _run("ip", "-n", namespace, "addr", "add", f"{self.addresses[side]}/30", "dev", device)
            _run("ip", "-n", namespace, "link", "set", device, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            if self.bandwidth_bps is not None:
                tbf = tbf_arguments(self.bandwidth_bps)
                _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf)

    def _delete(self) -> None:
        # Deleting a namespace deletes the veth end in it, and with it the pair.
        for namespace in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)

    def describe(self) -> str:
        return (f"{self.namespaces['a']} ({self.address_a}) <-> {self.namespaces['b']} ({self.address_b}), "
                f"bandwidth {format_bandwidth(self.bandwidth_bps)}")
