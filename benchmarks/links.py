"""Emulated network links between services: a user-space TCP delay line with bandwidth and faults.

The kernel of a test machine often has no netem qdisc and Toxiproxy is not at hand, so a benchmark
that wants the orchestrator, draft and target a few milliseconds apart puts a `DelayLine` (a small
asyncio TCP proxy, standard library only) in front of each service and points the client at it:

    async with DelayLine(("127.0.0.1", target_port), LinkSpec(rtt_ms=5, bandwidth_bps=1e9)) as line:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{line.port}")

How a link behaves
  - Delay: every chunk read from one peer is stamped with its arrival time and written to the other
    peer at arrival + rtt/2 (+ its serialization time). A queue per direction and a timer for the
    chunk at its head do the waiting, so delays never add up across chunks: 50 back-to-back
    messages at rtt 40 ms all arrive about 20 ms after they were sent, not 50 x 20 ms.
  - Bandwidth: each direction of a link is one FIFO wire shared by all its connections. A chunk
    of n bytes occupies it for n*8/bandwidth s once the chunks before it are through, so B bytes
    take about B*8/bandwidth + rtt/2. Large reads go out in slices of about half a millisecond of
    the wire's time (16 KiB at least), so they arrive as a stream rather than in one burst.
  - Connection set-up costs what a TCP handshake would: the client's first bytes leave no earlier
    than one rtt after the accept, the upstream's no earlier than 1.5 rtt (the server accepts when
    the client's ACK arrives), so a first exchange on a new connection takes about two rtts.
    `charge_handshake=False` (`--no-handshake`) turns this off.
  - Backpressure: a direction of a connection holds at most `queue_limit_bytes` (default 4 MiB plus
    the bandwidth-delay product one way); past that the proxy stops reading from the sender, and
    TCP flow control pushes back on it. On a link without a bandwidth limit this caps a connection
    at about queue_limit_bytes / (rtt/2), like a TCP window: 1.6 GB/s at rtt 5 ms.
  - The line's own speed is its CPU's: a link faster than the line can forward is bounded by the
    line, not by its setting (docs/design/across-a-network.md has the figures of one host).
  - A peer that resets its connection: the reset travels the link behind the data already sent
    and then resets the other peer.
  - Faults: `stall()` keeps every connection open but forwards nothing until `resume()` (arriving
    data is held, up to the queue bound, then the senders are pushed back); `reset()` aborts every
    open connection with a TCP RST on both sides (the peers' reads fail with ECONNRESET) and goes on
    accepting; `refuse(True)` resets each new connection as soon as it is accepted, until
    `refuse(False)`.
  - Counters: `snapshot()` gives bytes forwarded each way (`bytes_up`: client -> upstream,
    `bytes_down`), connections accepted, open, refused and reset, and the bytes held (read, not
    yet delivered).

Own cost of the line: two extra loopback hops and an event-loop pass each way, tens of microseconds
per message round trip, far below the millisecond round trips the line emulates (at rtt 0 a chunk is
written from the read callback itself, with no timer). `python -m benchmarks.links --measure-overhead`
measures it on the host at hand (an in-process 64-byte ping-pong, direct and through the line).

Command line (run from the repository root; runs until SIGTERM or SIGINT):

    python -m benchmarks.links --listen 127.0.0.1:0 --upstream 127.0.0.1:50061 --rtt-ms 5 --bandwidth 1gbit
      -> link ready: 127.0.0.1:41234 -> 127.0.0.1:50061 rtt 5.0 ms bandwidth 1 Gbit/s

    python -m benchmarks.links --link draft=127.0.0.1:0,127.0.0.1:50061,5,1gbit \\
                               --link target=127.0.0.1:0,127.0.0.1:50062,5,10gbit
      -> one ready line per link, in the order given, each ending in "name NAME"

  --link NAME=LISTEN,UPSTREAM,RTT_MS,BANDWIDTH  repeatable; several links in one process
  --bandwidth / BANDWIDTH   NUMBER followed by bit, kbit, mbit, gbit or tbit (per second, powers
                            of ten as in tc), or "unlimited" (the default)
  --no-handshake            do not charge connection set-up
  --measure-overhead        print the line's own added latency (in-process ping-pong) and exit

  --control JSON            a file read on SIGHUP: {"NAME": {"rtt_ms": 5, "bandwidth": "1gbit"}} changes
                            those links while they run; every link's counters line follows, then
                            "links set"

  Signals drive faults from another process, on every link of the process: SIGUSR1 toggles
  stall/resume (it prints "link stalled: NAME" or "link resumed: NAME"), SIGUSR2 resets the open
  connections ("link reset: NAME N connections"). On SIGTERM/SIGINT it prints, per link, one line
  "link counters: {JSON of snapshot()}" and exits 0. Every line is flushed at once; benchmarks
  read them with `parse_ready_line` and `parse_counters_line`.

Where the code lives: this module holds LinkSpec, the bandwidth words and DelayLine; the connection
internals (wires, flows, sockets) are in benchmarks/link_flows.py, the command line in
benchmarks/link_cli.py and the self-measurement in benchmarks/link_overhead.py. Their public names
(parse_ready_line, parse_counters_line, CONTROL_DONE, measure_added_latency, ...) are importable
from here as before.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.link_flows import MIN_SLICE_BYTES, SLICE_S, _Connection, _Wire, _reset_transport

if TYPE_CHECKING:
    from benchmarks.link_cli import (
        COUNTERS_PREFIX,
        CONTROL_DONE,
        READY_PREFIX,
        LinkOption,
        main,
        parse_address,
        parse_counters_line,
        parse_link_option,
        parse_ready_line,
        ready_line,
        serve_links,
    )
    from benchmarks.link_overhead import measure_added_latency

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_LIMIT_BYTES = 4 * 1024 * 1024

_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_UNLIMITED_WORDS = {"unlimited", "none", "inf"}
_BANDWIDTH_DISPLAY = (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3))


def parse_bandwidth(text: str) -> float | None:
    """Bits per second from "1gbit", "100mbit", "2.5gbit" ...; None for "unlimited"."""
    word = text.strip().lower()
    if word in _UNLIMITED_WORDS:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)", word)
    if match is None or match.group(2) not in _BANDWIDTH_UNITS:
        raise ValueError(
            f"bandwidth {text!r}: expected a number with bit, kbit, mbit, gbit or tbit, or 'unlimited'"
        )
    bits_per_s = float(match.group(1)) * _BANDWIDTH_UNITS[match.group(2)]
    if bits_per_s <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return bits_per_s


def format_bandwidth(bits_per_s: float | None) -> str:
    """"1 Gbit/s", "100 Mbit/s", "unlimited"."""
    if bits_per_s is None:
        return "unlimited"
    for unit, scale in _BANDWIDTH_DISPLAY:
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


@dataclass(frozen=True)
class LinkSpec:
    """A link's round-trip time and its bandwidth per direction (None: unlimited)."""

    rtt_ms: float = 0.0
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if self.rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {self.rtt_ms}")
        if self.bandwidth_bps is not None and self.bandwidth_bps <= 0:
            raise ValueError(f"bandwidth_bps must be positive or None, got {self.bandwidth_bps}")

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000.0

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0


def default_queue_limit(spec: LinkSpec) -> int:
    """4 MiB on top of what a limited link holds in flight one way (its bandwidth-delay product),
    so that the queue bound never keeps a link below its bandwidth."""
    if spec.bandwidth_bps is None:
        return DEFAULT_QUEUE_LIMIT_BYTES
    return DEFAULT_QUEUE_LIMIT_BYTES + int(spec.bandwidth_bps / 8 * spec.one_way_s)




class DelayLine:
    """A TCP proxy from `listen_host:listen_port` to `upstream` that behaves like a network link."""

    def __init__(
        self,
        upstream: tuple[str, int],
        spec: LinkSpec = LinkSpec(),
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        name: str = "link",
        queue_limit_bytes: int | None = None,
        charge_handshake: bool = True,
    ) -> None:
        self.upstream = (upstream[0], int(upstream[1]))
        self.spec = spec
        self.listen_host = listen_host
        self.name = name
        self.queue_limit_bytes = queue_limit_bytes or default_queue_limit(spec)
        self.charge_handshake = charge_handshake
        self._listen_port = listen_port
        self._wire_up = _Wire(spec.bandwidth_bps)
        self._wire_down = _Wire(spec.bandwidth_bps)
        self._connections: set[_Connection] = set()
        self._connect_tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None
        self.stalled = False
        self.refusing = False
        self._accepting = False
        self._accepted = 0
        self._refused = 0
        self._resets = 0

    async def start(self) -> DelayLine:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Connection(self).client, self.listen_host, self._listen_port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._accepting = True
        return self

    async def stop(self) -> None:
        """Stop accepting and reset every open connection."""
        if self._server is None:
            return
        self._accepting = False
        self._server.close()
        for connection in list(self._connections):
            connection.abort()
        for task in self._connect_tasks:
            task.cancel()
        await asyncio.gather(*self._connect_tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> DelayLine:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def set_spec(self, spec: LinkSpec) -> None:
        """Change the link's delay and bandwidth from now on (chunks already on the link keep their times)."""
        if self.queue_limit_bytes == default_queue_limit(self.spec):
            self.queue_limit_bytes = default_queue_limit(spec)
        self.spec = spec
        self._wire_up.bandwidth_bps = self._wire_down.bandwidth_bps = spec.bandwidth_bps

    def stall(self) -> None:
        """Forward nothing, on any connection, until `resume()`; arriving data is held."""
        self.stalled = True

    def resume(self) -> None:
        self.stalled = False
        for connection in list(self._connections):
            connection.up.kick()
            connection.down.kick()

    def reset(self) -> int:
        """Reset every open connection (RST to both peers); new ones are accepted. Returns how many."""
        connections = list(self._connections)
        for connection in connections:
            connection.abort()
        self._resets += len(connections)
        # What the wire still carried was dropped with the connections.
        self._wire_up.free_at = self._wire_down.free_at = 0.0
        return len(connections)

    def refuse(self, refusing: bool = True) -> None:
        """While on, each new connection is reset as soon as it is accepted."""
        self.refusing = refusing

    def snapshot(self) -> dict:
        return {
            "name": self.name,
            "listen": self.address,
            "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
            "rtt_ms": self.spec.rtt_ms,
            "bandwidth_bps": self.spec.bandwidth_bps,
            "bytes_up": self._wire_up.bytes_forwarded,
            "bytes_down": self._wire_down.bytes_forwarded,
            "connections": self._accepted,
            "open_connections": len(self._connections),
            # Bytes read but not yet delivered (in flight on the link, or held by a stall).
            "held_bytes": sum(c.up.queued_bytes + c.down.queued_bytes for c in self._connections),
            "refused": self._refused,
            "resets": self._resets,
            "stalled": self.stalled,
        }

    @property
    def bytes_up(self) -> int:
        return self._wire_up.bytes_forwarded

    @property
    def bytes_down(self) -> int:
        return self._wire_down.bytes_forwarded

    @property
    def connections_accepted(self) -> int:
        return self._accepted

    def _admit(self, connection: _Connection) -> None:
        if self.refusing or not self._accepting:
            self._refused += 1
            connection.closed = True
            _reset_transport(connection.client.transport)
            return
        self._accepted += 1
        self._connections.add(connection)
        task = self._loop.create_task(connection.connect_upstream())
        self._connect_tasks.add(task)
        task.add_done_callback(self._connect_tasks.discard)

    def _forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)


# ---------------------------------------------------------------------------------------------
# Names of the command line and the self-measurement, importable from here as well

# Those modules import DelayLine from here, so their names are looked up on first use (PEP 562)
# rather than imported above: no import cycle, whichever module is imported first.
_CLI_NAMES = (
    "CONTROL_DONE",
    "COUNTERS_PREFIX",
    "READY_PREFIX",
    "LinkOption",
    "main",
    "parse_address",
    "parse_counters_line",
    "parse_link_option",
    "parse_ready_line",
    "ready_line",
    "serve_links",
)
_LAZY_EXPORTS = {
    **dict.fromkeys(_CLI_NAMES, "benchmarks.link_cli"),
    "measure_added_latency": "benchmarks.link_overhead",
}

__all__ = [
    "CONTROL_DONE",
    "COUNTERS_PREFIX",
    "DEFAULT_QUEUE_LIMIT_BYTES",
    "MIN_SLICE_BYTES",
    "READY_PREFIX",
    "SLICE_S",
    "DelayLine",
    "LinkOption",
    "LinkSpec",
    "default_queue_limit",
    "format_bandwidth",
    "main",
    "measure_added_latency",
    "parse_address",
    "parse_bandwidth",
    "parse_counters_line",
    "parse_link_option",
    "parse_ready_line",
    "ready_line",
    "serve_links",
]


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))


if __name__ == "__main__":
    from benchmarks.link_cli import main as _cli_main

    sys.exit(_cli_main())
