"""Memory files in RAM and on disk: read once while in use, changed in RAM, one writer per NPC.

A change applies at once to the NPC's memory in RAM (what every read sees: reads never wait for a
write), then its writer task writes the whole file with the store's atomic write. Changes made while
a write is in flight are written together by the next one. The caller of a change waits until it is
on disk; a caller cancelled at shutdown stops waiting, but the write goes on, and `flush()` waits
for it.

When the disk refuses a write (full: ENOSPC, read-only: EROFS, not writable: EACCES, any OSError):
the change stays in RAM, callers go on (a reply is never held up by the disk), and the NPC's writer
tries again with backoff (capped at `DISK_RETRY_CAP_SECONDS`), at once when another NPC's write has
gone through (`bridge.memory.faults`). Each file is rewritten whole, so once the disk takes writes
again it holds every change, in the order made; a temporary file a failed write could not remove is
removed then. With `keep_unwritten=False` (the `memory` commands, whose process ends at once) a
refused write raises `MemoryStoreError` instead and the NPC's memory goes back to what is on disk.

Files are read with aiofiles (once per NPC while it is active). A file not used for
`bridge.memory.active.IDLE_SECONDS`, and wholly on disk, is let go from RAM and read again when next
needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiofiles
import aiofiles.os
import structlog
from pydantic import ValidationError

from bridge.backoff import Backoff
from bridge.errors import MemoryStoreError
from bridge.memory.active import IDLE_SECONDS, ActiveTable
from bridge.memory.faults import DiskFaults
from bridge.memory.models import NPC_ID_PATTERN, MemoryFile, render

log = structlog.get_logger(__name__)

FILE_SUFFIX = ".json"
CORRUPT_MARKER = ".corrupt-"
DISK_RETRY_BASE_SECONDS = 1.0
DISK_RETRY_CAP_SECONDS = 30.0

Change = Callable[[MemoryFile], MemoryFile]
# Writes `text` to `path` atomically; a temporary file it could not remove goes in the list.
WriteFile = Callable[[Path, str, list[Path]], None]


def check_id(npc_id: str) -> None:
    # The id becomes a file name: refuse anything that could leave the memory folder.
    if not NPC_ID_PATTERN.fullmatch(npc_id):
        raise MemoryStoreError(f"not a valid npc id for a memory file: {npc_id!r}")


def _remove(paths: list[Path]) -> None:
    for stray in paths:
        with contextlib.suppress(OSError):
            stray.unlink(missing_ok=True)


@dataclass(eq=False)
class _NpcFile:
    """One NPC's memory in RAM, and how much of it is on disk."""

    content: MemoryFile  # every change applied: what reads see
    on_disk: MemoryFile  # as last written
    version: int = 0  # changes applied
    written: int = 0  # changes on disk
    failing: bool = False  # its last write failed: it waits for a retry
    writer: asyncio.Task[None] | None = None
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    def busy(self) -> bool:
        """Changes not on disk yet: never let go."""
        return self.written < self.version or (self.writer is not None and not self.writer.done())

    def give_up(self, error: Exception) -> None:
        """Back to what is on disk; every caller waiting gets `error`."""
        self.content, self.version, self.failing = self.on_disk, self.written, False
        self.release(None, error)

    def release(self, upto: int | None, error: Exception | None = None) -> None:
        """Wake the callers whose change is on disk (`upto`), or all of them (None: it failed)."""
        still = []
        for version, waiter in self.waiters:
            if upto is not None and version > upto:
                still.append((version, waiter))
            elif not waiter.done():  # a cancelled caller's future is already done
                waiter.set_result(None) if error is None else waiter.set_exception(error)
        self.waiters = still


class MemoryFiles:
    """Every NPC's memory file under one folder, as the store changes them."""

    def __init__(
        self,
        directory: Path,
        *,
        write: WriteFile,
        keep_unwritten: bool = True,
        idle_seconds: float = IDLE_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        retry_base_seconds: float = DISK_RETRY_BASE_SECONDS,
    ) -> None:
        self.directory = directory
        self._write = write
        self._keep_unwritten = keep_unwritten
        self._retry_base = retry_base_seconds
        self._files: ActiveTable[_NpcFile] = ActiveTable(_NpcFile.busy, idle_seconds=idle_seconds, clock=monotonic)
        self._loading: dict[str, asyncio.Task[MemoryFile]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # writers, and changes waiting for their file
        self._disk = DiskFaults(monotonic)
        self._strays: list[Path] = []  # temporary files a failed write could not remove

    def path(self, npc_id: str) -> Path:
        check_id(npc_id)
        return self.directory / f"{npc_id}{FILE_SUFFIX}"

    def in_memory(self) -> list[str]:
        """Ids of the NPCs whose memory is held in RAM now."""
        return list(self._files)

    async def get(self, npc_id: str) -> MemoryFile:
        """The NPC's whole memory (empty when there is none yet), every change made so far included."""
        return (await self._state(npc_id)).content

    async def _state(self, npc_id: str) -> _NpcFile:
        state = self._files.find(npc_id)
        if state is not None:
            return state
        check_id(npc_id)
        task = self._loading.get(npc_id)
        if task is None:
            task = self._loading[npc_id] = asyncio.create_task(self._read(npc_id), name=f"memory-read-{npc_id}")
        try:
            # Shielded: one caller cancelled must not cancel the read the others wait for.
            content = await asyncio.shield(task)
        finally:
            if task.done() and self._loading.get(npc_id) is task:
                del self._loading[npc_id]
        return self._files.find(npc_id) or self._files.add(npc_id, _NpcFile(content, content))

    async def _read(self, npc_id: str) -> MemoryFile:
        path = self.path(npc_id)
        try:
            async with aiofiles.open(path, encoding="utf-8") as handle:
                raw = await handle.read()
        except FileNotFoundError:
            return MemoryFile.empty(npc_id)
        except (OSError, UnicodeDecodeError) as exc:
            return await self._set_aside(npc_id, path, exc)
        try:
            loaded = MemoryFile.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            return await self._set_aside(npc_id, path, exc)
        if loaded.npc_id != npc_id:
            log.warning("memory_file_npc_id_mismatch", path=str(path), npc_id=loaded.npc_id)
            loaded = loaded.model_copy(update={"npc_id": npc_id})
        return loaded

    async def _set_aside(self, npc_id: str, path: Path, error: Exception) -> MemoryFile:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        aside = path.with_name(f"{path.name}{CORRUPT_MARKER}{stamp}")
        try:
            await aiofiles.os.replace(path, aside)
        except OSError as exc:
            raise MemoryStoreError(f"memory file {path} is unreadable and cannot be moved aside: {exc}") from exc
        log.error(
            "memory_file_corrupt",
            path=str(path),
            moved_to=str(aside),
            error=type(error).__name__,
            detail=str(error)[:200],
            npc=npc_id,
        )
        return MemoryFile.empty(npc_id)

    async def flush(self, timeout_seconds: float) -> bool:
        """Wait (at most `timeout_seconds`) for writes in flight or waiting for the disk; True when
        every change is on disk."""
        pending = {task for task in self._tasks if not task.done()}
        if pending:
            self._disk.retry_now()  # a disk that has room again by now should not wait out a backoff
            await asyncio.wait(pending, timeout=timeout_seconds)
        unwritten = self._unwritten()
        if unwritten:
            log.error("memory_flush_timeout", unfinished=len(unwritten), npc_ids=unwritten[:20])
        return not unwritten

    async def change(self, npc_id: str, change: Change) -> None:
        """Apply `change` to the NPC's memory now; return once it is on disk (or kept for a retry)."""
        if self._files.peek(npc_id) is not None:
            await self._apply(npc_id, change)
            return
        # The file is read first: in a task of its own, shielded, so that a caller cancelled while
        # it is read still makes its change (and `flush` waits for it).
        task = asyncio.create_task(self._apply(npc_id, change), name=f"memory-change-{npc_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _apply(self, npc_id: str, change: Change) -> None:
        state = await self._state(npc_id)
        # Applied now, with no await before it: changes keep their order, and reads see them at once.
        state.content = change(state.content)
        state.version += 1
        if state.writer is None or state.writer.done():
            state.writer = asyncio.create_task(self._writer(npc_id, state), name=f"memory-write-{npc_id}")
            self._tasks.add(state.writer)
            state.writer.add_done_callback(self._tasks.discard)
        if state.failing:
            return  # the disk refused its last write: the change waits in RAM with the others
        waiter = asyncio.get_running_loop().create_future()
        state.waiters.append((state.version, waiter))
        await waiter

    async def _writer(self, npc_id: str, state: _NpcFile) -> None:
        """Write the NPC's file until every change is on disk; on a failing disk, retry with backoff."""
        backoff = Backoff(base_seconds=self._retry_base, cap_seconds=DISK_RETRY_CAP_SECONDS)
        path = self.path(npc_id)
        while state.written < state.version:
            version, content = state.version, state.content
            try:
                # Rendered here, on the event loop: the C encoder holds the GIL, so in a thread it
                # would stall the loop just as long, and up to a switch interval longer.
                await asyncio.to_thread(self._write, path, render(content), self._strays)
            except OSError as exc:
                if not self._keep_unwritten:
                    state.give_up(MemoryStoreError(f"cannot write memory file {path}: {exc}"))
                    return
                state.failing = True
                self._disk.failed(path, exc, self._unwritten)
                state.release(None)  # the callers go on; their changes wait here
                await self._disk.wait(backoff.next_delay())
                continue
            except Exception as exc:  # a bug, not the disk: never retried in a loop
                log.exception("memory_write_crashed", npc=npc_id)
                state.give_up(MemoryStoreError(f"cannot write memory file {path}: {type(exc).__name__}"))
                return
            state.on_disk, state.written, state.failing = content, version, False
            state.release(version)
            self._disk.succeeded()
            if self._strays:
                strays, self._strays = self._strays, []
                await asyncio.to_thread(_remove, strays)

    def _unwritten(self) -> list[str]:
        return [npc_id for npc_id in self._files if (s := self._files.peek(npc_id)) and s.written < s.version]
