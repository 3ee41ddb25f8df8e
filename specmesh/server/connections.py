"""Bounds on the connections a public listening port accepts, and on what they may hold.

A server that accepts every connection and keeps it forever can be taken down by connections
that never send a byte: each holds a file descriptor, and once the process's file limit is
reached nothing can be accepted or opened (not even the channels to the model services), while
the accept loop logs the failure as fast as it retries. So every client-facing port gets:

- a cap on its connections, sized below the process's file limit so that a reserve of
  descriptors stays free for the process itself (its channels, files, the metrics port);
- a handshake timeout: a connection that has not completed its HTTP/2 preface (gRPC) or sent
  a whole request head (HTTP) within it is closed, so silent connections cost only seconds;
- an idle timeout for connections with nothing in flight, a maximum age for gRPC connections
  (with a grace for the calls they carry), keep-alive pings, and a cap on a gRPC connection's
  concurrent streams.

The soft RLIMIT_NOFILE is raised to the hard limit at start-up: the soft default (often 1024)
is a compatibility value, not a budget. `quiet_accept_errors` rate-limits what is still logged
when descriptors run out. docs/configuration.md explains the defaults and how to size them.
"""

from __future__ import annotations

import argparse
import logging
import resource
import threading
import time
from dataclasses import dataclass

DEFAULT_RESERVE = 1024  # descriptors kept for the process: channels to the services, files, /metrics
CLIENT_PORTS = 2  # the gRPC and the HTTP port share what the reserve leaves
MAX_CONNECTION_AGE_GRACE_S = 600.0  # a connection past its age still finishes the calls it carries


@dataclass(frozen=True)
class ConnectionLimits:
    """One listening port's limits; 0 = unbounded (age) or derived (max_connections)."""

    max_connections: int = 0  # 0: (file limit - reserve) / CLIENT_PORTS
    reserve: int = DEFAULT_RESERVE
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_connection_age_s: float = 0.0  # 0: no limit (long generations may run for minutes)
    max_concurrent_streams: int = 100  # per gRPC connection; an HTTP/1.1 connection carries one request
    keepalive_s: float = 60.0  # gRPC server pings an otherwise silent connection this often

    def connection_cap(self, file_limit: int | None = None) -> int:
        """The configured cap, else this port's share of the file limit after the reserve (at least 16)."""
        if self.max_connections > 0:
            return self.max_connections
        limit = file_limit if file_limit is not None else file_limit_now()
        return max(16, (limit - self.reserve) // CLIENT_PORTS)


def file_limit_now() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return hard if soft == resource.RLIM_INFINITY else soft


def raise_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the most an unprivileged process may); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # some platforms cap below an infinite hard limit
            pass
    return file_limit_now()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def grpc_server_options(limits: ConnectionLimits) -> list[tuple[str, int]]:
    """grpc core's own channel arguments for `limits` (the server applies them per connection)."""
    options = [
        ("grpc.max_allowed_incoming_connections", limits.connection_cap()),
        # max_connection_idle only watches connections whose HTTP/2 handshake completed: a
        # connection that never sends its preface is bounded by the handshake timeout alone.
        ("grpc.server_handshake_timeout_ms", _ms(limits.handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(limits.idle_timeout_s)),
        # Unbounded, a burst of 10,000 calls on one connection got most of them (and some of other
        # connections' calls) CANCELLED by grpc; bounded, the client queues what is past the limit.
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # Streams past that limit wait in the client's queue, as HTTP/2 intends; grpc's overload
        # protection would instead reset the ones a burst sends before the limit's SETTINGS frame
        # arrives, which clients see as UNAVAILABLE rather than their call's real answer.
        ("grpc.http.overload_protection", 0),
        ("grpc.keepalive_time_ms", _ms(limits.keepalive_s)),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Clients may ping as often as every 10 s, even between calls; more often is a GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if limits.max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", _ms(limits.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", _ms(MAX_CONNECTION_AGE_GRACE_S))]
    return options


class RateLimitedFilter(logging.Filter):
    """Lets one record whose message contains a marker through per interval; counts the rest.

    The record let through says how many were dropped since the last one, so the log still
    shows that (and how often) descriptors ran out, without a traceback per failed accept.
    """

    def __init__(self, markers: tuple[str, ...], interval_s: float = 10.0):
        super().__init__()
        self.markers, self.interval_s = markers, interval_s
        self.dropped, self._last = 0, float("-inf")
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]}"
        if not any(marker in text for marker in self.markers):
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self.dropped += 1
                return False
            self._last, dropped, self.dropped = now, self.dropped, 0
        record.msg = f"{record.msg} ({dropped} more like it in the last {self.interval_s:g} s left out)"
        record.exc_info, record.exc_text = None, None  # the traceback is the same every time
        return True


ACCEPT_ERROR_MARKERS = ("out of system resource", "Too many open files")
_installed: RateLimitedFilter | None = None


def quiet_accept_errors(interval_s: float = 10.0) -> RateLimitedFilter:
    """Rate-limit asyncio's accept-failure records ("socket.accept() out of system resource"); idempotent."""
    global _installed
    if _installed is None:
        _installed = RateLimitedFilter(ACCEPT_ERROR_MARKERS, interval_s)
        logging.getLogger("asyncio").addFilter(_installed)
    return _installed


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The client-facing ports' bounds: config-file settings of `specmesh serve` (docs/configuration.md)."""
    defaults = ConnectionLimits()
    for flag, field, kind, help_text in _SETTINGS:
        parser.add_argument(flag, dest=field, type=kind, default=getattr(defaults, field),
                            metavar="S" if field.endswith("_s") else "N", help=help_text)


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**{field: getattr(args, field) for _, field, _, _ in _SETTINGS})


def positive_seconds(text: str) -> float:
    """A duration that must be positive (a zero timeout would close every connection at once)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


# (flag, ConnectionLimits field, type, help): one definition for the flags and the options built from them.
_SETTINGS = (
    ("--max-connections", "max_connections", int,
     "connections each client-facing port holds at once; 0 = its share of the file limit after connection-reserve"),
    ("--connection-reserve", "reserve", int, "file descriptors the orchestrator keeps free of client connections"),
    ("--handshake-timeout", "handshake_timeout_s", positive_seconds,
     "close a connection that has not sent its HTTP/2 preface or first request head by then"),
    ("--idle-timeout", "idle_timeout_s", positive_seconds,
     "close a client connection with no request in flight for this long"),
    ("--max-connection-age", "max_connection_age_s", float,
     "gRPC: close a connection this old once its calls end (0 = never)"),
    ("--max-concurrent-streams", "max_concurrent_streams", int, "gRPC: calls one client connection may carry at once"),
    ("--keepalive-interval", "keepalive_s", positive_seconds,
     "gRPC: ping a silent client connection this often (dead peers are dropped)"),
)
