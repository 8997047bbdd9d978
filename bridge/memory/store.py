"""Per-NPC memory files on disk: cached, one writer per NPC, atomic writes (memory.md "The file").

Every change runs as a tracked task shielded from its caller's cancellation: a reply cancelled at
shutdown never leaves a change half applied, and `flush()` waits for the ones still in flight.
A write goes to a temporary file in the same folder, is flushed and fsynced, renamed over the file,
and the folder is fsynced, so the file on disk is always either the old or the new valid JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiofiles
import aiofiles.os
import structlog
from pydantic import ValidationError

from bridge.errors import MemoryStoreError
from bridge.memory.checks import Kept, apply_kept
from bridge.memory.models import NPC_ID_PATTERN, Memory, MemoryFile, OutboxItem, PendingLine

log = structlog.get_logger(__name__)

FILE_SUFFIX = ".json"
TEMP_MARKER = ".tmp-"
CORRUPT_MARKER = ".corrupt-"

Change = Callable[[MemoryFile], MemoryFile]


def _check_id(npc_id: str) -> None:
    # The id becomes a file name: refuse anything that could leave the memory folder.
    if not NPC_ID_PATTERN.fullmatch(npc_id):
        raise MemoryStoreError(f"not a valid npc id for a memory file: {npc_id!r}")


def render(content: MemoryFile) -> str:
    """The file's text: one key a line, and one list item (a memory, a pending line) a line.

    As readable as `indent=2` for a person who opens the file, and cheap to rewrite: each item's line
    is serialised once and kept with it (`json.dumps(..., indent=2)` of the whole file ran the
    pure-Python encoder, ~1.7 ms of the event loop per write with a full pending conversation).
    `outbox` is written only while it holds something.
    """
    fields: list[tuple[str, str | tuple[str, ...]]] = [
        ("version", json.dumps(content.version)),
        ("npc_id", json.dumps(content.npc_id, ensure_ascii=False)),
        ("memories", tuple(item.json_line for item in content.memories)),
        ("pending", tuple(item.json_line for item in content.pending)),
    ]
    if content.outbox:
        fields.append(("outbox", tuple(item.json_line for item in content.outbox)))
    lines = ["{"]
    for number, (key, value) in enumerate(fields):
        comma = "," if number < len(fields) - 1 else ""
        if isinstance(value, str):
            lines.append(f'  "{key}": {value}{comma}')
        elif value:
            items = ",\n".join(f"    {item}" for item in value)
            lines.append(f'  "{key}": [\n{items}\n  ]{comma}')
        else:
            lines.append(f'  "{key}": []{comma}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    """Temp file, fsync, rename over, fsync the folder: the file is whole, old or new, after a crash."""
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
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryStore:
    """Memory files of all NPCs under one folder; `limit` memories at most per NPC (oldest forgotten)."""

    def __init__(self, directory: Path, *, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.directory = directory
        self.limit = limit
        self._cache: dict[str, MemoryFile] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._changes: set[asyncio.Task[MemoryFile]] = set()

    def path(self, npc_id: str) -> Path:
        _check_id(npc_id)
        return self.directory / f"{npc_id}{FILE_SUFFIX}"

    def _lock(self, npc_id: str) -> asyncio.Lock:
        return self._locks.setdefault(npc_id, asyncio.Lock())

    # --- reading -------------------------------------------------------------------------------

    async def load(self, npc_id: str) -> MemoryFile:
        """The NPC's whole memory file (empty when there is none yet), as last written.

        Reads never wait for a write in flight (an fsync takes ~12 ms): they see the file as it was
        before it, and the cache takes the new content only once it is on disk. Recall sits on the
        reply path; it must not queue behind the previous reply's note.
        """
        cached = self._cache.get(npc_id)
        if cached is not None:
            return cached
        async with self._lock(npc_id):
            return await self._loaded(npc_id)

    async def _loaded(self, npc_id: str) -> MemoryFile:
        """Cached file; read on first use. Caller holds the NPC's lock."""
        cached = self._cache.get(npc_id)
        if cached is not None:
            return cached
        path = self.path(npc_id)
        try:
            async with aiofiles.open(path, encoding="utf-8") as handle:
                raw = await handle.read()
        except FileNotFoundError:
            loaded = MemoryFile.empty(npc_id)
        except (OSError, UnicodeDecodeError) as exc:
            loaded = await self._set_aside(npc_id, path, exc)
        else:
            try:
                loaded = MemoryFile.model_validate(json.loads(raw))
            except (ValueError, ValidationError) as exc:
                loaded = await self._set_aside(npc_id, path, exc)
            if loaded.npc_id != npc_id:
                log.warning("memory_file_npc_id_mismatch", path=str(path), npc_id=loaded.npc_id)
                loaded = loaded.model_copy(update={"npc_id": npc_id})
        self._cache[npc_id] = loaded
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
        """Note one exchange; on disk when this returns."""
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
            if index >= len(f.memories):  # shortened meanwhile by the limit: nothing left to forget
                return f
            return f.model_copy(update={"memories": (*f.memories[:index], *f.memories[index + 1 :])})

        await self._change(npc_id, change)
        return forgotten

    async def add_outbox(self, npc_id: str, items: Iterable[OutboxItem]) -> None:
        queued = tuple(items)
        if queued:
            await self._change(npc_id, lambda f: f.model_copy(update={"outbox": (*f.outbox, *queued)}))

    async def remove_outbox(self, npc_id: str, count: int) -> None:
        """Drop the first `count` outbox items (those the shared service took)."""
        if count > 0:
            await self._change(npc_id, lambda f: f.model_copy(update={"outbox": f.outbox[count:]}))

    async def flush(self, timeout_seconds: float) -> bool:
        """Wait (at most `timeout_seconds`) for changes in flight; True when none is left."""
        pending = {task for task in self._changes if not task.done()}
        if not pending:
            return True
        _, still = await asyncio.wait(pending, timeout=timeout_seconds)
        if still:
            log.error("memory_flush_timeout", unfinished=len(still))
        return not still

    async def _change(self, npc_id: str, change: Change) -> MemoryFile:
        _check_id(npc_id)
        task = asyncio.create_task(self._apply(npc_id, change), name=f"memory-write-{npc_id}")
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)
        # Shielded: a cancelled caller stops waiting, but the change still completes as one piece.
        return await asyncio.shield(task)

    async def _apply(self, npc_id: str, change: Change) -> MemoryFile:
        async with self._lock(npc_id):
            updated = change(await self._loaded(npc_id))
            await self._write(npc_id, updated)
            # The cache follows the disk: a failed write leaves both as they were.
            self._cache[npc_id] = updated
            return updated

    async def _write(self, npc_id: str, content: MemoryFile) -> None:
        path = self.path(npc_id)
        # Rendered here, on the event loop: the C encoder holds the GIL, so in a thread it would stall
        # the loop just as long, and up to a switch interval longer.
        text = render(content)
        try:
            # The file work in one thread hop, not one per call as aiofiles does (about 8 hops of ~0.1 ms,
            # each a wake-up of the event loop that replies in flight wait behind).
            await asyncio.to_thread(_write_atomically, path, text)
        except OSError as exc:
            raise MemoryStoreError(f"cannot write memory file {path}: {exc}") from exc
