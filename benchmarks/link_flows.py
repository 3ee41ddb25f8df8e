"""Connection internals of the delay line (benchmarks/links.py): wires, flows, sides, connections.

A `DelayLine` owns two `_Wire`s (one per direction, shared by all its connections) and one
`_Connection` per accepted client. A connection joins the client's socket and the proxy's socket to
the upstream (two `_Side`s) by two `_Flow`s, one per direction, that hold each chunk until it is due.
How the link behaves is described in benchmarks/links.py; nothing here is public.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.links import DelayLine

# The delay line's logger, shared by its modules: one name to configure or filter.
logger = logging.getLogger("benchmarks.links")

SLICE_S = 0.0005
MIN_SLICE_BYTES = 16 * 1024


class _Wire:
    """One direction of a link, shared by all its connections: FIFO serialization at its bandwidth."""

    def __init__(self, bandwidth_bps: float | None) -> None:
        self.bandwidth_bps = bandwidth_bps
        self.free_at = 0.0
        self.bytes_forwarded = 0

    def departure(self, ready_at: float, nbytes: int) -> float:
        """When the last bit of `nbytes` ready at `ready_at` has left, after the chunks before it."""
        if self.bandwidth_bps is None:
            return ready_at
        start = max(ready_at, self.free_at)
        self.free_at = start + nbytes * 8 / self.bandwidth_bps
        return self.free_at

    def slices(self, data: bytes) -> list[bytes | memoryview]:
        """`data` in pieces of about SLICE_S of the wire's time: a large read then arrives as a
        stream rather than in one burst at the end of its serialization time."""
        if self.bandwidth_bps is None:
            return [data]
        size = max(MIN_SLICE_BYTES, int(self.bandwidth_bps / 8 * SLICE_S))
        if len(data) <= size:
            return [data]
        view = memoryview(data)
        return [view[i : i + size] for i in range(0, len(data), size)]


# Markers a flow carries behind its data: the sender's FIN, and its reset.
_EOF = object()
_RESET = object()


def _reset_transport(transport: asyncio.BaseTransport) -> None:
    """Close with a TCP RST, not a FIN, so the peer's next read fails with ECONNRESET."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            # SO_LINGER on with a zero timeout: close() discards unsent data and sends RST.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed by the peer; abort() below is all that is left to do
    transport.abort()


class _Flow:
    """One direction of one connection: chunks held until their due time, then written in order."""

    def __init__(self, line: DelayLine, wire: _Wire, not_before: float) -> None:
        self._line = line
        self._wire = wire
        self._not_before = not_before
        self.source: _Side | None = None
        self.dest: _Side | None = None
        self._chunks: collections.deque[tuple[float, object]] = collections.deque()
        self._queued_bytes = 0
        self._last_due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self.finished = False

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def push(self, data: bytes) -> None:
        ready_at = max(self._line._loop.time(), self._not_before)
        for piece in self._wire.slices(data):
            self._append(self._wire.departure(ready_at, len(piece)) + self._line.spec.one_way_s, piece)
            self._queued_bytes += len(piece)
        self._pause_reading_if_full()
        self.kick()

    def push_marker(self, marker: object) -> None:
        ready_at = max(self._line._loop.time(), self._not_before)
        self._append(ready_at + self._line.spec.one_way_s, marker)
        self.kick()

    def _append(self, due: float, payload: object) -> None:
        due = max(due, self._last_due)  # FIFO: nothing overtakes what was sent before it
        self._last_due = due
        self._chunks.append((due, payload))

    def kick(self) -> None:
        """Write every chunk that is due, and arm a timer for the next one."""
        if self._timer is not None:
            return  # armed for the head chunk; every later chunk is due no earlier
        now = self._line._loop.time()
        while self._chunks and self._can_write():
            due, payload = self._chunks[0]
            if due > now:
                self._timer = self._line._loop.call_at(due, self._on_timer)
                break
            self._chunks.popleft()
            self._deliver(payload)
        self._resume_reading_if_drained()

    def _on_timer(self) -> None:
        self._timer = None
        self.kick()

    def _can_write(self) -> bool:
        return not self._line.stalled and self.dest is not None and self.dest.writable

    def _deliver(self, payload: object) -> None:
        if payload is _RESET:
            self.dest.connection.abort()
        elif payload is _EOF:
            if self.dest.transport.can_write_eof():
                self.dest.transport.write_eof()
            self.finished = True
            self.dest.connection.flow_finished()
        else:
            self.dest.transport.write(payload)
            self._queued_bytes -= len(payload)
            self._wire.bytes_forwarded += len(payload)

    def _pause_reading_if_full(self) -> None:
        if not self._reading_paused and self._queued_bytes > self._line.queue_limit_bytes:
            self._reading_paused = True
            self.source.transport.pause_reading()

    def _resume_reading_if_drained(self) -> None:
        # Resume at half the limit, not just below it, so reading does not flap per chunk.
        if self._reading_paused and self._queued_bytes <= self._line.queue_limit_bytes // 2:
            self._reading_paused = False
            if not self.source.transport.is_closing():
                self.source.transport.resume_reading()

    def clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._chunks.clear()
        self._queued_bytes = 0


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: what it reads feeds `incoming`, `outgoing` writes to it."""

    def __init__(self, connection: _Connection, incoming: _Flow, outgoing: _Flow) -> None:
        self.connection = connection
        self.incoming = incoming
        self.outgoing = outgoing
        self.transport: asyncio.Transport | None = None
        self._write_paused = False

    @property
    def writable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self._write_paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.connection.side_made(self)

    def data_received(self, data: bytes) -> None:
        self.incoming.push(data)

    def eof_received(self) -> bool:
        self.incoming.push_marker(_EOF)
        return True  # keep the socket open: the other direction may still carry data

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self.outgoing.kick()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connection.side_lost(self, exc)


class _Connection:
    """A client's connection and the proxy's connection to the upstream, joined by two flows."""

    def __init__(self, line: DelayLine) -> None:
        self._line = line
        accepted_at = line._loop.time()
        handshake_s = line.spec.rtt_s if line.charge_handshake else 0.0
        # The client's connect() would have returned after SYN/SYN-ACK (one rtt); the server's
        # accept() after the client's ACK arrived (1.5 rtt).
        self.up = _Flow(line, line._wire_up, accepted_at + handshake_s)
        self.down = _Flow(line, line._wire_down, accepted_at + 1.5 * handshake_s)
        self.client = _Side(self, incoming=self.up, outgoing=self.down)
        self.upstream = _Side(self, incoming=self.down, outgoing=self.up)
        self.up.source, self.up.dest = self.client, self.upstream
        self.down.source, self.down.dest = self.upstream, self.client
        self.closed = False

    def side_made(self, side: _Side) -> None:
        if side is self.client:
            self._line._admit(self)
        elif self.closed:
            _reset_transport(side.transport)  # reset while the upstream was connecting
        else:
            self.up.kick()  # data the client sent meanwhile

    async def connect_upstream(self) -> None:
        host, port = self._line.upstream
        try:
            await self._line._loop.create_connection(lambda: self.upstream, host, port)
        except OSError as exc:
            logger.warning("link %s: cannot connect to upstream %s:%d: %s", self._line.name, host, port, exc)
            self.abort()  # the client sees a reset, as if the far end had refused it

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if self.closed:
            return
        # The peer went away without the proxy closing it: drop what was still headed to it,
        # and let its reset travel the link behind the data it sent before.
        side.outgoing.clear()
        side.incoming.push_marker(_RESET)

    def flow_finished(self) -> None:
        if self.up.finished and self.down.finished and not self.closed:
            self.closed = True
            for side in (self.client, self.upstream):
                side.transport.close()
            self._line._forget(self)

    def abort(self) -> None:
        """Reset both sockets now, dropping whatever the flows still hold."""
        if self.closed:
            return
        self.closed = True
        self.up.clear()
        self.down.clear()
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.transport.is_closing():
                _reset_transport(side.transport)
        self._line._forget(self)
