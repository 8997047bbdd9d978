"""Running the real `npc-bridge` process in tests: its environment, start, stop and JSON log lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BRIDGE = (sys.executable, "-m", "bridge")
STOP_SECONDS = 30.0


def bridge_env(memory_dir: Path, **values: str) -> dict[str, str]:
    """This process's environment without any NPC_BRIDGE_* or systemd variable, plus `values`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("NPC_BRIDGE_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env.update(
        NPC_BRIDGE_CHARACTERS_DIR=str(REPO / "characters"),
        NPC_BRIDGE_MEMORY_DIR=str(memory_dir),
        PYTHONUNBUFFERED="1",
    )
    env.update(values)
    return env


async def start_bridge(env: dict[str, str], log_path: Path, *args: str) -> asyncio.subprocess.Process:
    """`npc-bridge run` (or `args`) with stdout and stderr appended to `log_path`."""
    with log_path.open("ab") as log_file:
        return await asyncio.create_subprocess_exec(
            *BRIDGE, *(args or ("run",)), env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT
        )


async def stop_bridge(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM and the exit code (killed, and an assertion error, if it does not stop in time)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_SECONDS)
        except TimeoutError:
            proc.kill()
            raise AssertionError(f"npc-bridge did not stop within {STOP_SECONDS} s of SIGTERM") from None
    assert proc.returncode is not None
    return proc.returncode


def log_events(log_path: Path) -> list[dict[str, Any]]:
    """The JSON log lines the daemon wrote."""
    return [
        json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines() if line.startswith("{")
    ]
