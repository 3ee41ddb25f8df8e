"""The delay line's own cost (benchmarks/links.py): ping-pong direct and through a line at rtt 0.

`python -m benchmarks.links --measure-overhead` runs `measure_added_latency` and prints its result.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time

from benchmarks.links import DelayLine, LinkSpec


def _echo_connection(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass  # reset by the line as it stops


def _accept_echo_connections(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the listener was shut down: the measurement is over
        threading.Thread(target=_echo_connection, args=(conn,), daemon=True).start()


def _ping_pong_median_us(port: int, rounds: int, size: int) -> float:
    message = b"x" * size
    samples = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            started = time.perf_counter()
            conn.sendall(message)
            received = 0
            while received < size:
                received += len(conn.recv(size - received))
            samples.append(time.perf_counter() - started)
    return statistics.median(samples[rounds // 10 :]) * 1e6  # the first tenth warms up


async def measure_added_latency(rounds: int = 2000, size: int = 64) -> dict[str, float]:
    """Median ping-pong round trip in us, direct and through a DelayLine at rtt 0.

    The echo server and the client are blocking sockets on threads of their own, so the line's
    event loop does nothing but forward (only one of the three is busy at any time).
    """
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    threading.Thread(target=_accept_echo_connections, args=(listener,), daemon=True).start()
    try:
        direct_us = await asyncio.to_thread(_ping_pong_median_us, port, rounds, size)
        async with DelayLine(("127.0.0.1", port), LinkSpec()) as line:
            through_us = await asyncio.to_thread(_ping_pong_median_us, line.port, rounds, size)
    finally:
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        listener.close()
    return {"direct_us": direct_us, "through_line_us": through_us, "added_us": through_us - direct_us}
