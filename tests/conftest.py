"""Fixtures shared by the suites that run the whole daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.world.harness import WorldServer, node_available

LIVE_WORLD_TOKEN = "live-world-token-5c1d"


@pytest.fixture
async def live_world() -> AsyncIterator[WorldServer]:
    """A reference Colyseus 0.18 world (tests/world) on a free loopback port, token LIVE_WORLD_TOKEN."""
    if not node_available():
        pytest.skip("node and npm are needed for the reference world (tests/world)")
    server = await WorldServer.start("0.18", LIVE_WORLD_TOKEN)
    try:
        yield server
    finally:
        await server.stop()
