"""Fixtures for world tests: the reference worlds, installed once per session, one per Colyseus version."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.world.harness import VERSIONS, Version, WorldServer, ensure_installed, node_available

WORLD_TOKEN = "test-world-token-3b7c"

StartWorld = Callable[..., Awaitable[WorldServer]]


@pytest.fixture(scope="session")
def world_installed() -> tuple[Version, ...]:
    """`npm ci` both reference worlds once per session (skips the world tests without Node)."""
    if not node_available():
        pytest.skip("node and npm are needed for the reference worlds")
    for version in VERSIONS:
        ensure_installed(version)
    return VERSIONS


@pytest.fixture(params=VERSIONS, ids=lambda v: f"colyseus-{v}")
async def start_world(
    request: pytest.FixtureRequest, world_installed: tuple[Version, ...]
) -> AsyncIterator[StartWorld]:
    """`await start_world(say_parts=True, extra_npcs=[...])`: a reference world of each version, stopped after."""
    servers: list[WorldServer] = []

    async def start(**options: Any) -> WorldServer:
        options.setdefault("reconnect_seconds", 20)
        server = await WorldServer.start(request.param, WORLD_TOKEN, **options)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()


@pytest.fixture
async def world(start_world: StartWorld) -> WorldServer:
    """A fresh reference world of each Colyseus version, on a free loopback port."""
    return await start_world()
