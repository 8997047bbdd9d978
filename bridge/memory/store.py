"""Per-NPC memory files on disk: kept in RAM while in use, one writer per NPC, atomic writes, and
nothing lost to a failing disk (memory.md "The file").

A change applies at once to the NPC's memory in RAM (what every read sees: reads never wait for a
write), then its writer task writes the whole file: to a temporary file in the same folder, flushed
and fsynced, renamed over the file, and the folder fsynced, so the file on disk is always either the
old or the new valid JSON, and a failed write removes its temporary file. Changes made while a write
is in flight are written together by the next one. The caller of a change waits until it is on disk;
a caller cancelled at shutdown stops waiting, but the write goes on, and `flush()` waits for it.

When the disk refuses a write (full: ENOSPC, read-only: EROFS, not writable: EACCES, any OSError):
the change stays in RAM, callers go on (a reply is never held up by the disk), and the NPC's writer
tries again with backoff (capped at `DISK_RETRY_CAP_SECONDS`), at once when another NPC's write has
gone through. Each file is rewritten whole, so once the disk takes writes again it holds every
change, in the order made. One warning a minute while writes fail (`memory_write_failed`, with how
many NPCs wait), one line when they go through again (`memory_write_recovered`), and a temporary file
a failure could not remove is removed then. A store made with `keep_unwritten=False` (the
`memory` commands, whose process ends at once) raises `MemoryStoreError` instead and goes back to
what is on disk.

Files are read with aiofiles (once per NPC while it is active). Writes take one thread hop
(`asyncio.to_thread`) for the open, write, fsync, rename and folder fsync together: aiofiles would
make each of those its own hop, each a wake-up of the event loop that replies in flight wait behind.
A memory file not used for `bridge.memory.active.IDLE_SECONDS` (and wholly on disk) is let go from
RAM and read again when next needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
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
from bridge.memory.checks import Kept, apply_kept
from bridge.memory.faults import DiskFaults
from bridge.memory.models import NPC_ID_PATTERN, Memory, MemoryFile, OutboxItem, PendingLine
from bridge.memory.models import render as render  # the file format, also imported from here

log = structlog.get_logger(__name__)

FILE_SUFFIX = ".json"
TEMP_MARKER = ".tmp-"
CORRUPT_MARKER = ".corrupt-"
DISK_RETRY_BASE_SECONDS = 1.0
DISK_RETRY_CAP_SECONDS = 30.0

Change = Callable[[MemoryFile], MemoryFile]


def _check_id(npc_id: str) -> None:
    # The id becomes a file name: refuse anything that could leave the memory folder.
    if not NPC_ID_PATTERN.fullmatch(npc_id):
        raise MemoryStoreError(f"not a valid npc id for a memory file: {npc_id!r}")


def _write_atomically(path: Path, text: str, strays: list[Path]) -> None:
    """Temp file, fsync, rename over, fsync the folder: the file is whole, old or new, after a crash.

    A temporary file that cannot be removed after a failure (the folder went read-only meanwhile) is
    added to `strays`, for removal after the next write that goes through.
    """
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{uuid.uuid4().hex}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
        _fsync_dir(path.parent)
    finally:
        try:
            os.remove(temp)
        except FileNotFoundError:
            pass
        except OSError:
            strays.append(temp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class MemoryStore:
    """Memory files of all NPCs under one folder; `limit` memories at most per NPC (oldest forgotten)."""

    def __init__(
        self,
        directory: Path,
        *,
        limit: int,
        keep_unwritten: bool = True,
        idle_seconds: float = IDLE_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        retry_base_seconds: float = DISK_RETRY_BASE_SECONDS,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.directory = directory
        self.limit = limit
        self._keep_unwritten = keep_unwritten
        self._retry_base = retry_base_seconds
        self._files: ActiveTable[_NpcFile] = ActiveTable(_NpcFile.busy, idle_seconds=idle_seconds, clock=monotonic)
        self._loading: dict[str, asyncio.Task[MemoryFile]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # writers, and changes waiting for their file
        self._disk = DiskFaults(monotonic)
        self._strays: list[Path] = []  # temporary files a failed write could not remove

    def path(self, npc_id: str) -> Path:
        _check_id(npc_id)
        return self.directory / f"{npc_id}{FILE_SUFFIX}"

    def in_memory(self) -> list[str]:
        """Ids of the NPCs whose memory is held in RAM now."""
        return list(self._files)

    # --- reading -------------------------------------------------------------------------------

    async def load(self, npc_id: str) -> MemoryFile:
        """The NPC's whole memory (empty when there is none yet), every change made so far included."""
        return (await self._state(npc_id)).content

    async def _state(self, npc_id: str) -> _NpcFile:
        state = self._files.find(npc_id)
        if state is not None:
            return state
        _check_id(npc_id)
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

    async def pending(self, npc_id: str) -> tuple[PendingLine, ...]:
        return (await self.load(npc_id)).pending

    async def memories(self, npc_id: str) -> tuple[Memory, ...]:
        return (await self.load(npc_id)).memories

    async def recent(self, npc_id: str, n: int) -> tuple[Memory, ...]:
        """The newest `n` memories, oldest first."""
        if n <= 0:
            return ()
        return (await self.load(npc_id)).memories[-n:]

    async def outbox(self, npc_id: str) -> tuple[OutboxItem, ...]:
        return (await self.load(npc_id)).outbox

    def npc_ids_on_disk(self) -> list[str]:
        """Ids of every memory file in the folder (leftover temporary and corrupt files are skipped)."""
        if not self.directory.is_dir():
            return []
        return sorted(
            path.stem
            for path in self.directory.glob(f"*{FILE_SUFFIX}")
            if NPC_ID_PATTERN.fullmatch(path.stem) and path.is_file()
        )

    async def npc_ids_with_pending(self) -> list[str]:
        """NPCs whose file holds a conversation not yet extracted (scanned at start-up)."""
        return [memory.npc_id for memory in await self._load_all() if memory.pending]

    async def npc_ids_with_outbox(self) -> list[str]:
        """NPCs whose checked memories still wait for the shared service."""
        return [memory.npc_id for memory in await self._load_all() if memory.outbox]

    async def _load_all(self) -> list[MemoryFile]:
        loaded: list[MemoryFile] = []
        for npc_id in self.npc_ids_on_disk():
            try:
                loaded.append(await self.load(npc_id))
            except MemoryStoreError as exc:  # one broken file must not stop the others' start-up
                log.error("memory_file_unreadable", npc=npc_id, error=str(exc))
        return loaded

    # --- changing ------------------------------------------------------------------------------

    async def append_pending(self, npc_id: str, entry: PendingLine) -> None:
        """Note one exchange; on disk when this returns (while the disk takes writes)."""
        await self._change(npc_id, lambda f: f.model_copy(update={"pending": (*f.pending, entry)}))

    async def clear_pending(self, npc_id: str, count: int) -> None:
        """Drop the first `count` pending lines (those extracted); lines noted since then stay."""
        if count <= 0:
            return
        await self._change(npc_id, lambda f: f.model_copy(update={"pending": f.pending[count:]}))

    async def add_memories(self, npc_id: str, texts: Sequence[str], heard_at: datetime, source: str) -> None:
        """Append memories; past the limit the oldest are forgotten."""
        if texts:
            await self.record_extraction(npc_id, taken=0, texts=texts, heard_at=heard_at, source=source)

    async def record_extraction(
        self,
        npc_id: str,
        *,
        taken: int,
        texts: Sequence[str] = (),
        heard_at: datetime | None = None,
        source: str = "",
        outbox: Sequence[OutboxItem] = (),
        kept: Sequence[Kept] = (),
    ) -> None:
        """In one write: add the kept memories (or queue them in the outbox) and clear the first
        `taken` pending lines, so a crash cannot store memories yet keep the lines they came from.
        `texts` are new memories; `kept` may also refresh or replace stored ones (`apply_kept`)."""
        added = (*(Kept(text) for text in texts), *kept)
        if added and heard_at is None:
            raise ValueError("heard_at is required with texts")
        queued = tuple(outbox)
        if not added and not queued and taken <= 0:
            return

        def change(f: MemoryFile) -> MemoryFile:
            memories = apply_kept(f.memories, added, heard_at=heard_at, source=source) if heard_at else f.memories
            if len(memories) > self.limit:
                log.info("memory_forgotten", npc=npc_id, count=len(memories) - self.limit, reason="limit")
                memories = memories[-self.limit :]
            return f.model_copy(
                update={
                    "memories": memories,
                    "outbox": (*f.outbox, *queued),
                    "pending": f.pending[max(taken, 0) :],
                }
            )

        await self._change(npc_id, change)

    async def forget(self, npc_id: str, index: int | None) -> int:
        """Forget the memory at `index` (0-based), or all of them for None; returns how many went.

        Raises IndexError for an index out of range.
        """
        current = await self.load(npc_id)
        if index is not None and not 0 <= index < len(current.memories):
            raise IndexError(f"no memory number {index + 1} for {npc_id}")
        forgotten = len(current.memories) if index is None else 1

        def change(f: MemoryFile) -> MemoryFile:
            if index is None:
                return f.model_copy(update={"memories": ()})
            return f.model_copy(update={"memories": (*f.memories[:index], *f.memories[index + 1 :])})

        await self._change(npc_id, change)
        return forgotten

    async def remove_outbox(self, npc_id: str, count: int) -> None:
        """Drop the first `count` outbox items (those the shared service took)."""
        if count > 0:
            await self._change(npc_id, lambda f: f.model_copy(update={"outbox": f.outbox[count:]}))

    async def flush(self, timeout_seconds: float) -> bool:
        """Wait (at most `timeout_seconds`) for writes in flight or waiting for the disk; True when
        every change is on disk."""
        pending = {task for task in self._tasks if not task.done()}
        if pending:
            await asyncio.wait(pending, timeout=timeout_seconds)
        unwritten = self._unwritten()
        if unwritten:
            log.error("memory_flush_timeout", unfinished=len(unwritten), npc_ids=unwritten[:20])
        return not unwritten

    # --- writing -------------------------------------------------------------------------------

    async def _change(self, npc_id: str, change: Change) -> None:
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
                await asyncio.to_thread(_write_atomically, path, render(content), self._strays)
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
