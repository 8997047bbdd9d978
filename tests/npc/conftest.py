"""The `rig` fixture: a running dispatcher against a loopback fake LLM (tests/npc/rig.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.npc.rig import Rig, dispatcher_rig


@pytest.fixture
async def rig(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    overrides: dict[str, Any] = getattr(request, "param", {})
    async with dispatcher_rig(tmp_path, **overrides) as running:
        yield running
