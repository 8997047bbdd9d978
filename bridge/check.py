"""`npc-bridge check`: validate configuration and characters, probe the world and the LLM, report.

Exit codes as `run`'s: 2 when anything `run` would refuse to start with (settings, token, characters,
memory directory), else 1 when a peer (the world, the LLM, a model on it) is not there, else 0.
Warnings (an unknown NPC_BRIDGE_* name, a setting that does not apply) never change the exit code.
"""

from __future__ import annotations

import asyncio

import httpx

from bridge.errors import ConfigError
from bridge.llm.base import model_available
from bridge.llm.factory import make_backend
from bridge.npc.characters import load_roster
from bridge.preflight import prepare_memory_dir
from bridge.settings import Settings, typo_warnings

PROBE_TIMEOUT_SECONDS = 5.0


class _Report:
    def __init__(self) -> None:
        self.problems = 0
        self.config_problems = 0

    def ok(self, what: str) -> None:
        print(f"  ok    {what}", flush=True)

    def warn(self, what: str) -> None:
        print(f"  warn  {what}", flush=True)

    def fail(self, what: str, *, config: bool = False) -> None:
        self.problems += 1
        self.config_problems += config
        print(f"  FAIL  {what}", flush=True)

    def exit_code(self) -> int:
        return 2 if self.config_problems else 1 if self.problems else 0


async def run_check(settings: Settings) -> int:
    report = _Report()
    print("npc-bridge check", flush=True)
    report.ok(f"configuration valid (backend {settings.llm_backend}, model {settings.llm_model})")
    for warning in typo_warnings():
        report.warn(warning)
    try:
        settings.require_token()
        report.ok("world token present (not shown)")
    except ConfigError as exc:
        report.fail(str(exc), config=True)

    model_names: set[str] = {settings.llm_model}
    try:
        roster = load_roster(settings.characters_dir)
        voiced = sorted(roster.voiced)
        report.ok(
            f"{len(roster.characters)} characters in {settings.characters_dir.resolve()}; voiced: {', '.join(voiced)}"
        )
        if not voiced:
            report.fail("NPC_BRIDGE_CHARACTERS_DIR: no character has talk 'worker'", config=True)
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
        for line in exc.lines:
            report.fail(line, config=True)

    _check_memory_dir(settings, report)
    await _check_world(settings, report)
    await _check_llm(settings, model_names, report)
    print(f"{'all good' if not report.problems else f'{report.problems} problem(s)'}", flush=True)
    return report.exit_code()


def _check_memory_dir(settings: Settings, report: _Report) -> None:
    try:
        prepare_memory_dir(settings.memory_dir)
        report.ok(f"memory directory {settings.memory_dir.resolve()} writable")
    except ConfigError as exc:
        report.fail(str(exc), config=True)


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
