"""Test-only fault injection: force a crash into a named component of a running daemon.

Off — `wrap` hands the component back untouched — unless the environment variable
NPC_BRIDGE_TEST_FAULTS names a directory; nothing else reads that variable, and operators never set
it. When it is set, each supervised component is watched for a file named after it in that
directory (`world`, `events`, `replies`, `memory`, `watchdog`): the component is then stopped where it
is (cancelled, so its own clean-up runs) and `InjectedCrash` escapes from it, as an unexpected
exception would. The file holds how many crashes in a row to force (default 1): a component that
finds its file when it (re)starts crashes again at once, which is how tests drive a component into
crashing again and again. The file is removed when used up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

VARIABLE = "NPC_BRIDGE_TEST_FAULTS"
POLL_SECONDS = 0.05


class InjectedCrash(Exception):
    """A crash forced by a test through NPC_BRIDGE_TEST_FAULTS."""


def wrap(
    name: str, component: Callable[[], Awaitable[None]], environ: Mapping[str, str] | None = None
) -> Callable[[], Awaitable[None]]:
    """The component itself, or (with NPC_BRIDGE_TEST_FAULTS set) one that crashes on request."""
    directory = (os.environ if environ is None else environ).get(VARIABLE)
    if not directory:
        return component
    trigger = Path(directory) / name

    async def crashing() -> None:
        if _take(trigger):
            raise InjectedCrash(f"{name}: forced crash at start")
        task = asyncio.ensure_future(component())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=POLL_SECONDS)
                if not task.done() and _take(trigger):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    raise InjectedCrash(f"{name}: forced crash")
            task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return crashing


def _take(trigger: Path) -> bool:
    """Use up one crash from the trigger file; False when there is none."""
    try:
        text = trigger.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return False
    left = int(text) - 1 if text.isdigit() else 0
    with contextlib.suppress(OSError):
        if left > 0:
            trigger.write_text(str(left), encoding="ascii")
        else:
            trigger.unlink()
    return True
