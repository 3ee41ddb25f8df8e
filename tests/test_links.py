"""The emulated network link (benchmarks/links.py): delay, bandwidth, faults, counters, gRPC, CLI.

Everything runs over 127.0.0.1. Tests wait on events and reads, never on sleeps; elapsed times are
checked against lower bounds (a link is never faster than its rtt or bandwidth), and against
generous upper bounds only where they show that delays do not add up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from benchmarks.links import (
    CONTROL_DONE,
    DelayLine,
    LinkSpec,
    format_bandwidth,
    parse_address,
    parse_bandwidth,
    parse_counters_line,
    parse_link_option,
    parse_ready_line,
)
from benchmarks.netns import NamespacePair, netns_available
from orchestrator.serving.clients import open_channel

REPO_ROOT = Path(__file__).resolve().parent.parent
IO_TIMEOUT_S = 10.0
# Shorter than any stall a test waits out: an answer that has not come by then is held by the link.
HELD_S = 0.3
# Timers may fire this much early (the event loop's clock resolution and float rounding).
EARLY_S = 0.002


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()  # the client's EOF, passed on: the client reads EOF in turn
    except ConnectionError:
        writer.transport.abort()  # the link reset us, as a test asked


@pytest.fixture
async def echo_port():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _connect(line: DelayLine) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", line.port)


async def _echo_once(reader, writer, message: bytes = b"ping") -> float:
    """Seconds for `message` to come back."""
    started = time.monotonic()
    writer.write(message)
    assert await asyncio.wait_for(reader.readexactly(len(message)), IO_TIMEOUT_S) == message
    return time.monotonic() - started


def test_bandwidth_and_address_parsing():
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("10gbit") == 1e10
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("2.5GBit") == 2.5e9
    assert parse_bandwidth("unlimited") is None
    for bad in ("1gbps", "fast", "0mbit", ""):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)
    assert [format_bandwidth(b) for b in (1e9, 1e8, 2.5e9, None)] == [
        "1 Gbit/s", "100 Mbit/s", "2.5 Gbit/s", "unlimited"]
    assert parse_address("[::1]:0") == ("::1", 0)
    option = parse_link_option("draft=127.0.0.1:0,127.0.0.1:5000,5,1gbit")
    assert (option.name, option.upstream, option.spec) == ("draft", ("127.0.0.1", 5000), LinkSpec(5.0, 1e9))
    with pytest.raises(ValueError):
        LinkSpec(rtt_ms=-1)


async def test_echo_round_trip_takes_at_least_the_rtt(echo_port):
    rtt_s = 0.04
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=40)) as line:
        reader, writer = await _connect(line)
        # A new connection also pays for the TCP handshake the line emulates: about two rtts.
        assert await _echo_once(reader, writer) >= 2 * rtt_s - EARLY_S
        for _ in range(3):
            assert await _echo_once(reader, writer) >= rtt_s - EARLY_S
        writer.close()


async def test_without_handshake_a_new_connection_pays_one_rtt(echo_port):
    spec = LinkSpec(rtt_ms=100)
    async with DelayLine(("127.0.0.1", echo_port), spec, charge_handshake=False) as line:
        reader, writer = await _connect(line)
        assert 0.1 - EARLY_S <= await _echo_once(reader, writer) < 0.2
        writer.close()


async def _arrival_times(reader: asyncio.StreamReader, count: int, size: int) -> list[float]:
    arrivals = []
    for _ in range(count):
        await reader.readexactly(size)
        arrivals.append(time.monotonic())
    return arrivals


async def test_pipelined_chunks_do_not_accumulate_delay(echo_port):
    """50 chunks sent 2 ms apart each come back one rtt after they left, not 50 one-way delays late."""
    rtt_s, count, size = 0.04, 50, 16
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=40)) as line:
        reader, writer = await _connect(line)
        await _echo_once(reader, writer)  # past the handshake
        receiving = asyncio.ensure_future(_arrival_times(reader, count, size))
        sent = []
        for index in range(count):
            sent.append(time.monotonic())
            writer.write(index.to_bytes(size, "big"))
            await asyncio.sleep(0.002)  # pacing, so that the line reads the chunks one by one
        arrivals = await asyncio.wait_for(receiving, IO_TIMEOUT_S)
        latencies = [arrived - left for left, arrived in zip(sent, arrivals)]
        assert min(latencies) >= rtt_s - EARLY_S
        # Accumulating delays would put the last chunk seconds behind; allow scheduling noise only.
        assert max(latencies) < rtt_s + 0.25
        writer.close()


async def test_bandwidth_limits_a_bulk_transfer(echo_port):
    size = 2 * 1024 * 1024
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(bandwidth_bps=parse_bandwidth("100mbit"))) as line:
        reader, writer = await _connect(line)
        elapsed = await _echo_once(reader, writer, os.urandom(size))
        # Each direction is its own wire, so the echo overlaps the upload: about one transfer time.
        assert elapsed >= size * 8 / 100e6 - EARLY_S
        assert elapsed < 3.0
        assert (line.bytes_up, line.bytes_down) == (size, size)
        writer.close()


async def test_connections_of_a_link_share_its_bandwidth(echo_port):
    size = 1024 * 1024
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(bandwidth_bps=100e6)) as line:
        connections = [await _connect(line) for _ in range(2)]
        started = time.monotonic()
        await asyncio.gather(*(_echo_once(r, w, os.urandom(size)) for r, w in connections))
        assert time.monotonic() - started >= 2 * size * 8 / 100e6 - EARLY_S
        for _, writer in connections:
            writer.close()


async def test_stall_holds_data_until_resume(echo_port):
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=10)) as line:
        reader, writer = await _connect(line)
        await _echo_once(reader, writer)
        line.stall()
        writer.write(b"held")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), HELD_S)
        assert line.snapshot()["held_bytes"] == 4 and line.bytes_up == 4
        line.resume()
        assert await asyncio.wait_for(reader.readexactly(4), IO_TIMEOUT_S) == b"held"
        assert line.snapshot()["open_connections"] == 1
        writer.close()


async def test_reset_fails_open_connections_and_new_ones_work(echo_port):
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=5)) as line:
        reader, writer = await _connect(line)
        await _echo_once(reader, writer)
        assert line.reset() == 1
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(100), IO_TIMEOUT_S)
        reader, writer = await _connect(line)
        await _echo_once(reader, writer)
        snapshot = line.snapshot()
        assert (snapshot["resets"], snapshot["connections"], snapshot["open_connections"]) == (1, 2, 1)
        writer.close()


async def test_refused_connections_are_reset_until_accepted_again(echo_port):
    async with DelayLine(("127.0.0.1", echo_port)) as line:
        line.refuse(True)
        reader, writer = await _connect(line)
        with pytest.raises(ConnectionError):
            writer.write(b"ping")
            await asyncio.wait_for(reader.read(100), IO_TIMEOUT_S)
        line.refuse(False)
        reader, writer = await _connect(line)
        await _echo_once(reader, writer)
        assert (line.snapshot()["refused"], line.connections_accepted) == (1, 1)
        writer.close()


async def test_counters_count_bytes_each_way_and_connections(echo_port):
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=2)) as line:
        for _ in range(3):
            reader, writer = await _connect(line)
            await _echo_once(reader, writer, b"x" * 1000)
            writer.close()
        snapshot = line.snapshot()
        assert (snapshot["bytes_up"], snapshot["bytes_down"], snapshot["connections"]) == (3000, 3000, 3)


async def test_eof_travels_the_link_and_closes_both_sides(echo_port):
    async with DelayLine(("127.0.0.1", echo_port), LinkSpec(rtt_ms=20)) as line:
        reader, writer = await _connect(line)
        writer.write(b"last words")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), IO_TIMEOUT_S) == b"last words"  # then EOF
        writer.close()
        assert line.snapshot()["open_connections"] == 0


async def test_a_peer_reset_reaches_the_other_peer():
    upstream_reset = asyncio.Event()

    async def reset_at_once(reader, writer):
        await reader.readexactly(4)
        # SO_LINGER 0: the close sends an RST rather than a FIN.
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        upstream_reset.set()

    server = await asyncio.start_server(reset_at_once, "127.0.0.1", 0)
    async with server, DelayLine(("127.0.0.1", server.sockets[0].getsockname()[1]), LinkSpec(rtt_ms=10)) as line:
        reader, writer = await _connect(line)
        writer.write(b"ping")
        await asyncio.wait_for(upstream_reset.wait(), IO_TIMEOUT_S)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(100), IO_TIMEOUT_S)


def _unused_port() -> int:
    """A local port that was just bound and released: nothing listens on it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_an_unreachable_upstream_resets_the_client():
    async with DelayLine(("127.0.0.1", _unused_port())) as line:
        reader, writer = await _connect(line)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(100), IO_TIMEOUT_S)


async def test_a_sender_is_pushed_back_while_the_link_holds_a_full_queue():
    limit = 256 * 1024
    size = 32 * 1024 * 1024
    received = 0
    all_received = asyncio.Event()

    async def sink(reader, writer):
        nonlocal received
        while data := await reader.read(1 << 20):
            received += len(data)
            if received == size:
                all_received.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, DelayLine(("127.0.0.1", port), queue_limit_bytes=limit) as line:
        reader, writer = await _connect(line)
        line.stall()
        writer.write(b"\0" * size)
        # The kernel's socket buffers take some megabytes; the line takes no more than its limit.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(writer.drain(), HELD_S)
        assert limit < line.snapshot()["held_bytes"] <= limit + 256 * 1024  # plus at most one read
        line.resume()
        await asyncio.wait_for(all_received.wait(), IO_TIMEOUT_S)
        assert line.bytes_up == size
        writer.close()


@pytest.fixture
async def health_server():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield port
    await server.stop(None)


async def _check(stub: health_pb2_grpc.HealthStub, timeout: float, wait_for_ready: bool = False) -> float:
    started = time.monotonic()
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - started


async def test_grpc_through_the_link_delays_stalls_and_reconnects(health_server):
    async with DelayLine(("127.0.0.1", health_server), LinkSpec(rtt_ms=10)) as line:
        channel = open_channel(line.address)  # a connection of its own (open_channel's local subchannel pool)
        async with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await _check(stub, IO_TIMEOUT_S)
            assert await _check(stub, IO_TIMEOUT_S) >= 0.01 - EARLY_S

            line.stall()
            with pytest.raises(grpc.aio.AioRpcError) as stalled:
                await _check(stub, HELD_S)
            assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            line.resume()
            await _check(stub, IO_TIMEOUT_S)

            assert line.reset() == 1
            # The channel notices the reset, then the next call reconnects through the link.
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), IO_TIMEOUT_S)
            await _check(stub, IO_TIMEOUT_S, wait_for_ready=True)
            assert line.connections_accepted == 2


async def _start_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.links", *args,
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
    )


async def _read_line(process: asyncio.subprocess.Process) -> str:
    return (await asyncio.wait_for(process.stdout.readline(), IO_TIMEOUT_S)).decode().strip()


async def test_cli_link_forwards_takes_signals_and_reports_counters(echo_port):
    process = await _start_cli("--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{echo_port}",
                               "--rtt-ms", "5", "--bandwidth", "1gbit")
    try:
        ready = await _read_line(process)
        assert ready.startswith("link ready: 127.0.0.1:")
        assert ready.endswith(f"-> 127.0.0.1:{echo_port} rtt 5.0 ms bandwidth 1 Gbit/s")
        port = parse_address(parse_ready_line(ready)["listen"])[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _echo_once(reader, writer) >= 0.005 - EARLY_S

        process.send_signal(signal.SIGUSR1)
        assert await _read_line(process) == "link stalled: link"
        writer.write(b"held")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), HELD_S)
        process.send_signal(signal.SIGUSR1)
        assert await _read_line(process) == "link resumed: link"
        assert await asyncio.wait_for(reader.readexactly(4), IO_TIMEOUT_S) == b"held"

        process.send_signal(signal.SIGUSR2)
        assert await _read_line(process) == "link reset: link 1 connections"
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(100), IO_TIMEOUT_S)

        process.send_signal(signal.SIGTERM)
        counters = parse_counters_line(await _read_line(process))
        assert (counters["bytes_up"], counters["bytes_down"], counters["resets"]) == (8, 8, 1)
        assert await asyncio.wait_for(process.wait(), IO_TIMEOUT_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_cli_runs_several_named_links(echo_port):
    process = await _start_cli("--link", f"draft=127.0.0.1:0,127.0.0.1:{echo_port},2,unlimited",
                               "--link", f"target=127.0.0.1:0,127.0.0.1:{echo_port},4,10gbit")
    try:
        ready = [parse_ready_line(await _read_line(process)) for _ in range(2)]
        assert [(r["name"], r["rtt_ms"], r["bandwidth"]) for r in ready] == [
            ("draft", "2.0", "unlimited"), ("target", "4.0", "10 Gbit/s")]
        for entry, message in zip(ready, (b"to draft", b"to the target")):
            reader, writer = await asyncio.open_connection(*parse_address(entry["listen"]))
            await _echo_once(reader, writer, message)
            writer.close()
        process.send_signal(signal.SIGTERM)
        counters = [parse_counters_line(await _read_line(process)) for _ in range(2)]
        assert [(c["name"], c["bytes_up"]) for c in counters] == [("draft", 8), ("target", 13)]
        assert await asyncio.wait_for(process.wait(), IO_TIMEOUT_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_cli_control_file_changes_a_running_link_and_reports_counters(echo_port, tmp_path):
    """SIGHUP applies the control file to the named link while its connections stay open, then prints every
    link's counters and "links set": a benchmark sweeps delays over one running stack."""
    control = tmp_path / "links.json"
    process = await _start_cli("--link", f"draft=127.0.0.1:0,127.0.0.1:{echo_port},0,unlimited",
                               "--link", f"target=127.0.0.1:0,127.0.0.1:{echo_port},0,unlimited",
                               "--control", str(control), "--no-handshake")
    try:
        ready = [parse_ready_line(await _read_line(process)) for _ in range(2)]
        reader, writer = await asyncio.open_connection(*parse_address(ready[0]["listen"]))
        await _echo_once(reader, writer, b"before")
        control.write_text(json.dumps({"draft": {"rtt_ms": 40, "bandwidth": "1gbit"}}))
        process.send_signal(signal.SIGHUP)
        counters = [parse_counters_line(await _read_line(process)) for _ in range(2)]
        assert await _read_line(process) == CONTROL_DONE
        assert [(c["name"], c["rtt_ms"], c["bandwidth_bps"], c["bytes_up"]) for c in counters] == [
            ("draft", 40.0, 1e9, 6), ("target", 0.0, None, 0)]
        assert await _echo_once(reader, writer, b"after") >= 0.040 - EARLY_S  # the same connection, delayed now
        process.send_signal(signal.SIGTERM)
    finally:
        if process.returncode is None:
            await asyncio.wait_for(process.wait(), IO_TIMEOUT_S)


_NETNS_SINK = """
import socket, sys
listener = socket.create_server((sys.argv[1], 5201))
print("ready", flush=True)
conn, _ = listener.accept()
while conn.recv(1 << 20):
    pass
conn.sendall(b"k")
"""

_NETNS_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 5201))
started = time.monotonic()
conn.sendall(b"\\0" * int(sys.argv[2]))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.monotonic() - started)
"""


@pytest.mark.skipif(not netns_available(), reason="needs root and a working `ip netns` and `tc`")
def test_namespace_pair_limits_bandwidth_with_tbf():
    size = 2 * 1024 * 1024
    with NamespacePair(bandwidth_bps=100e6) as pair:
        sink_args = pair.exec_args("b", [sys.executable, "-c", _NETNS_SINK, pair.address_b])
        with subprocess.Popen(sink_args, stdout=subprocess.PIPE, text=True) as sink:
            try:
                assert sink.stdout.readline().strip() == "ready"
                source = subprocess.run(
                    pair.exec_args("a", [sys.executable, "-c", _NETNS_SOURCE, pair.address_b, str(size)]),
                    capture_output=True, text=True, timeout=30, check=True)
                elapsed = float(source.stdout)
            finally:
                sink.kill()
    # tbf's burst lets about a millisecond of data through early.
    assert size * 8 / 100e6 - 0.01 <= elapsed < 5.0
