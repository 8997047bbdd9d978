"""What the keeper tests share: characters, settings with short delays, a running keeper."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bridge.llm._http import RetryPolicy
from bridge.llm.base import LLMBackend
from bridge.llm.gate import LLMGate
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import Character, Roster
from bridge.npc.prompt import format_memory_line
from bridge.settings import Settings

SILENCE_SECONDS = 0.3
RETRY_BASE_SECONDS = 0.05
FAST_RETRY = RetryPolicy(first_delay_seconds=0.01, max_delay_seconds=0.02, max_attempts=1)


def character(
    npc_id: str, *, backend: str = "file", extract: str = "silence", lane: str | None = None
) -> Character:
    return Character.model_validate(
        {
            "id": npc_id,
            "name": npc_id,
            "persona": "テスト用の店員。",
            "talk": "worker",
            "llm": {"model": None, "lane": lane},
            "memory": {"backend": backend, "extract": extract},
        }
    )


def roster() -> Roster:
    characters = [
        character("cafe-minori"),
        character("ryokan-fumi"),
        character("haruno", backend="shared", extract="inline", lane="strong"),
        character("home-silent", backend="shared"),  # shared memory, extracted after silence
    ]
    return Roster({c.id: c for c in characters})


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "memory_dir": tmp_path,
        "memory_silence_seconds": SILENCE_SECONDS,
        "timezone": "Asia/Tokyo",
    }
    values.update(overrides)
    return Settings(**values)


def make_keeper(
    tmp_path: Path,
    backend: LLMBackend,
    *,
    shared: SharedMemoryClient | None = None,
    gate: LLMGate | None = None,
    **overrides: Any,
) -> MemoryKeeper:
    config = settings(tmp_path, **overrides)
    return MemoryKeeper(
        store=MemoryStore(tmp_path, limit=config.memory_limit),
        backend=backend,
        gate=gate or LLMGate(1),
        roster=roster(),
        settings=config,
        shared=shared,
        retry_base_seconds=RETRY_BASE_SECONDS,
        retry_cap_seconds=0.2,
        extraction_deadline_seconds=5.0,
    )


@contextlib.asynccontextmanager
async def running(keeper: MemoryKeeper) -> AsyncIterator[MemoryKeeper]:
    task = asyncio.create_task(keeper.run(), name="test-keeper")
    await asyncio.sleep(0)
    try:
        yield keeper
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        left = [t for t in asyncio.all_tasks() if t.get_name().startswith("memory-extract") and not t.done()]
        assert left == [], "run() left tasks behind"


async def eventually(condition: Callable[[], bool], timeout_seconds: float = 5.0) -> None:
    async with asyncio.timeout(timeout_seconds):
        while not condition():  # noqa: ASYNC110 - polling files and fakes that signal nothing
            await asyncio.sleep(0.01)


def read_file(tmp_path: Path, npc_id: str) -> dict[str, Any]:
    path = tmp_path / f"{npc_id}.json"
    if not path.exists():
        return {"memories": [], "pending": []}
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


async def recalled_lines(keeper: MemoryKeeper, npc_id: str, query: str, previous: str | None = None) -> list[str]:
    """What the prompt shows of a recall: `- (M/D) text` lines, oldest first."""
    recalled = await keeper.recall(npc_id, query=query, previous=previous)
    return [format_memory_line(item.text, item.heard_at) for item in recalled]
