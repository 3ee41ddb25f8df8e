"""The command line of the delay line: `python -m benchmarks.links ...` (see benchmarks/links.py).

The module docstring of benchmarks/links.py describes the options, the lines printed (ready,
counters, "links set") and the signals (SIGUSR1 stall/resume, SIGUSR2 reset, SIGHUP control file,
SIGTERM/SIGINT counters and exit). Benchmarks that run the line in a process of its own read its
lines with `parse_ready_line` and `parse_counters_line`, both importable from benchmarks.links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from benchmarks.link_overhead import measure_added_latency
from benchmarks.links import DelayLine, LinkSpec, format_bandwidth, parse_bandwidth

# The delay line's logger, shared by its modules: one name to configure or filter.
logger = logging.getLogger("benchmarks.links")

READY_PREFIX = "link ready: "
COUNTERS_PREFIX = "link counters: "
CONTROL_DONE = "links set"  # the last line a SIGHUP prints
_READY_PATTERN = re.compile(
    r"link ready: (?P<listen>\S+) -> (?P<upstream>\S+) rtt (?P<rtt_ms>[0-9.]+) ms "
    r"bandwidth (?P<bandwidth>.+?)(?: name (?P<name>\S+))?$"
)


@dataclass(frozen=True)
class LinkOption:
    """One link of the command line."""

    name: str | None
    listen: tuple[str, int]
    upstream: tuple[str, int]
    spec: LinkSpec


def parse_address(text: str) -> tuple[str, int]:
    """("127.0.0.1", 50051) from "127.0.0.1:50051"; "[::1]:0" for IPv6."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def parse_link_option(text: str) -> LinkOption:
    """LinkOption from NAME=LISTEN,UPSTREAM,RTT_MS,BANDWIDTH."""
    name, sep, rest = text.partition("=")
    fields = rest.split(",")
    if not sep or not name or len(fields) != 4:
        raise ValueError(f"link {text!r}: expected NAME=LISTEN,UPSTREAM,RTT_MS,BANDWIDTH")
    listen, upstream, rtt_ms, bandwidth = fields
    spec = LinkSpec(rtt_ms=float(rtt_ms), bandwidth_bps=parse_bandwidth(bandwidth))
    return LinkOption(name, parse_address(listen), parse_address(upstream), spec)


def ready_line(line: DelayLine, named: bool) -> str:
    text = (
        f"{READY_PREFIX}{line.address} -> {line.upstream[0]}:{line.upstream[1]} "
        f"rtt {line.spec.rtt_ms:.1f} ms bandwidth {format_bandwidth(line.spec.bandwidth_bps)}"
    )
    return f"{text} name {line.name}" if named else text


def parse_ready_line(text: str) -> dict | None:
    """listen, upstream, rtt_ms, bandwidth, name (or None) of a ready line; None for other lines."""
    match = _READY_PATTERN.match(text.strip())
    return match.groupdict() if match else None


def parse_counters_line(text: str) -> dict | None:
    """The snapshot a counters line carries; None for other lines."""
    text = text.strip()
    return json.loads(text[len(COUNTERS_PREFIX) :]) if text.startswith(COUNTERS_PREFIX) else None


def _emit(text: str) -> None:
    print(text, flush=True)


def _toggle_stall(lines: list[DelayLine]) -> None:
    for line in lines:
        if line.stalled:
            line.resume()
            _emit(f"link resumed: {line.name}")
        else:
            line.stall()
            _emit(f"link stalled: {line.name}")


def _reset_all(lines: list[DelayLine]) -> None:
    for line in lines:
        _emit(f"link reset: {line.name} {line.reset()} connections")


def _apply_control(lines: list[DelayLine], control: Path | None) -> None:
    """SIGHUP: set each link named in the control file ({NAME: {"rtt_ms": .., "bandwidth": ..}}) to its spec,
    then print every link's counters, and "links set" last, so that a benchmark changes a running link and
    reads the bytes so far without restarting it (or the connections through it)."""
    try:
        wanted = json.loads(control.read_text()) if control is not None else {}
        for line in lines:
            if line.name in wanted:
                entry = wanted[line.name]
                bandwidth_bps = parse_bandwidth(str(entry.get("bandwidth", "unlimited")))
                line.set_spec(LinkSpec(float(entry.get("rtt_ms", 0.0)), bandwidth_bps))
    except (OSError, ValueError, TypeError, AttributeError) as error:
        logger.error("control file %s not applied: %s", control, error)
    for line in lines:
        _emit(COUNTERS_PREFIX + json.dumps(line.snapshot(), sort_keys=True))
    _emit(CONTROL_DONE)


async def serve_links(options: list[LinkOption], charge_handshake: bool = True, control: Path | None = None) -> None:
    """Run the links until SIGTERM or SIGINT; SIGUSR1 toggles stall, SIGUSR2 resets, SIGHUP applies the
    control file and prints the counters."""
    lines = [
        DelayLine(option.upstream, option.spec, listen_host=option.listen[0], listen_port=option.listen[1],
                  name=option.name or "link", charge_handshake=charge_handshake)
        for option in options
    ]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _toggle_stall, lines)
    loop.add_signal_handler(signal.SIGUSR2, _reset_all, lines)
    loop.add_signal_handler(signal.SIGHUP, _apply_control, lines, control)
    try:
        for line, option in zip(lines, options):
            await line.start()
            _emit(ready_line(line, named=option.name is not None))
        await stop.wait()
    finally:
        for line in lines:
            await line.stop()
    for line in lines:
        _emit(COUNTERS_PREFIX + json.dumps(line.snapshot(), sort_keys=True))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.links",
        description="Emulated network links (TCP delay lines with bandwidth and faults) between services.",
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any)")
    parser.add_argument("--upstream", help="HOST:PORT to forward to (one link)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time in ms (one link)")
    parser.add_argument("--bandwidth", default="unlimited", help="e.g. 1gbit, 100mbit, unlimited (one link)")
    parser.add_argument("--link", action="append", default=[], metavar="NAME=LISTEN,UPSTREAM,RTT_MS,BANDWIDTH",
                        help="one of several links in this process; repeatable")
    parser.add_argument("--no-handshake", action="store_true", help="do not charge connection set-up")
    parser.add_argument("--control", type=Path, default=None, metavar="JSON",
                        help='read on SIGHUP: {"NAME": {"rtt_ms": 5, "bandwidth": "1gbit"}, ...} sets those links')
    parser.add_argument("--measure-overhead", action="store_true",
                        help="print the line's own added latency at rtt 0 and exit")
    return parser


def _link_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[LinkOption]:
    if bool(args.upstream) == bool(args.link):
        parser.error("give either --upstream (one link) or one or more --link")
    try:
        if args.link:
            options = [parse_link_option(text) for text in args.link]
            names = [option.name for option in options]
            if len(set(names)) != len(names):
                parser.error(f"link names must differ: {', '.join(names)}")
            return options
        spec = LinkSpec(rtt_ms=args.rtt_ms, bandwidth_bps=parse_bandwidth(args.bandwidth))
        return [LinkOption(None, parse_address(args.listen), parse_address(args.upstream), spec)]
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.measure_overhead:
        _emit(json.dumps(asyncio.run(measure_added_latency())))
        return 0
    options = _link_options(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve_links(options, charge_handshake=not args.no_handshake, control=args.control))
    except OSError as exc:  # a listen address in use or not ours
        logger.error("cannot serve the links: %s", exc)
        return 1
    return 0
