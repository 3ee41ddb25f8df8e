"""A service's port is its own: a second server asked for a port in use fails to start instead of sharing it
(grpc's default SO_REUSEPORT would let it bind and deal clients between the two)."""

from __future__ import annotations

import pytest

from specmesh.server.grpc_server import start_server


async def test_a_second_server_on_a_port_in_use_fails_to_start():
    first, port, _ = await start_server(lambda server: None, [], "127.0.0.1:0")
    try:
        assert port > 0
        with pytest.raises(RuntimeError):
            await start_server(lambda server: None, [], f"127.0.0.1:{port}")
    finally:
        await first.stop(None)
    again, same_port, _ = await start_server(lambda server: None, [], f"127.0.0.1:{port}")  # freed: it binds
    await again.stop(None)
    assert same_port == port
