"""`npc-bridge check`: validate configuration and characters, probe the world and the LLM, report."""

from __future__ import annotations

import asyncio
import tempfile

import httpx

from bridge.errors import ConfigError
from bridge.llm.base import model_available
from bridge.llm.factory import make_backend
from bridge.npc.characters import load_roster
from bridge.settings import Settings

PROBE_TIMEOUT_SECONDS = 5.0


class _Report:
    def __init__(self) -> None:
        self.problems = 0

    def ok(self, what: str) -> None:
        print(f"  ok    {what}", flush=True)

    def warn(self, what: str) -> None:
        print(f"  warn  {what}", flush=True)

    def fail(self, what: str) -> None:
        self.problems += 1
        print(f"  FAIL  {what}", flush=True)


async def run_check(settings: Settings) -> int:
    report = _Report()
    print("npc-bridge check", flush=True)
    report.ok(f"configuration valid (backend {settings.llm_backend}, model {settings.llm_model})")
    try:
        if settings.token() is None:
            report.fail("NPC_BRIDGE_WORLD_TOKEN: not set (nor NPC_BRIDGE_WORLD_TOKEN_FILE); `run` needs it")
        else:
            report.ok("world token present (not shown)")
    except ConfigError as exc:
        report.fail(str(exc))

    model_names: set[str] = {settings.llm_model}
    try:
        roster = load_roster(settings.characters_dir)
        voiced = sorted(roster.voiced)
        report.ok(f"{len(roster.characters)} characters in {settings.characters_dir}; voiced: {', '.join(voiced)}")
        model_names |= {c.llm.model for c in roster.voiced.values() if c.llm.model}
        for character in roster.voiced.values():
            if character.memory.backend == "shared" and not settings.shared_memory_url:
                report.warn(
                    f"{character.id}: memory.backend 'shared' but NPC_BRIDGE_SHARED_MEMORY_URL is not set; "
                    "its memories stay in the local memory file"
                )
            if character.llm.lane and settings.llm_backend != "coordinator":
                report.warn(f"{character.id}: llm.lane {character.llm.lane!r} only applies to the coordinator backend")
    except ConfigError as exc:
        report.fail(str(exc))

    _check_memory_dir(settings, report)
    await _check_world(settings, report)
    await _check_llm(settings, model_names, report)
    print(f"{'all good' if not report.problems else f'{report.problems} problem(s)'}", flush=True)
    return 0 if not report.problems else 1


def _check_memory_dir(settings: Settings, report: _Report) -> None:
    directory = settings.memory_dir
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".check-", delete=True):
            pass
        report.ok(f"memory directory {directory} writable")
    except OSError as exc:
        report.fail(f"NPC_BRIDGE_MEMORY_DIR: {directory} not writable: {exc.strerror or exc}")


async def _check_world(settings: Settings, report: _Report) -> None:
    try:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_SECONDS) as client:
            response = await client.get(settings.world_url + "/")
        report.ok(f"world {settings.world_url} answers HTTP (status {response.status_code})")
    except httpx.HTTPError as exc:
        report.fail(f"world {settings.world_url} unreachable: {type(exc).__name__}: {exc}")


async def _check_llm(settings: Settings, model_names: set[str], report: _Report) -> None:
    backend = make_backend(settings)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_SECONDS * 2):
            models = await backend.list_models()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        report.fail(f"LLM {settings.llm_backend} at {settings.llm_url} unreachable: {type(exc).__name__}: {exc}")
        return
    finally:
        await backend.aclose()
    if models is None:
        report.ok(f"LLM {settings.llm_backend} at {settings.llm_url} answers (it does not list models)")
        return
    report.ok(f"LLM {settings.llm_backend} at {settings.llm_url} answers ({len(models)} models)")
    for name in sorted(model_names):
        if model_available(name, models):
            report.ok(f"model {name} available")
        else:
            report.fail(f"model {name} not on the server (has: {', '.join(models[:8]) or 'none'})")
