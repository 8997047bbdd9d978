"""Fixtures for world tests: the reference worlds, installed once per session, one per Colyseus version."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.world.harness import VERSIONS, Version, WorldServer, ensure_installed, node_available

WORLD_TOKEN = "test-world-token-3b7c"


@pytest.fixture(scope="session")
def world_installed() -> tuple[Version, ...]:
    """`npm ci` both reference worlds once per session (skips the world tests without Node)."""
    if not node_available():
        pytest.skip("node and npm are needed for the reference worlds")
    for version in VERSIONS:
        ensure_installed(version)
    return VERSIONS


@pytest.fixture(params=VERSIONS, ids=lambda v: f"colyseus-{v}")
async def world(request: pytest.FixtureRequest, world_installed: tuple[Version, ...]) -> AsyncIterator[WorldServer]:
    """A fresh reference world of each Colyseus version, on a free loopback port."""
    server = await WorldServer.start(request.param, WORLD_TOKEN, reconnect_seconds=20)
    try:
        yield server
    finally:
        await server.stop()
