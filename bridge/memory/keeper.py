"""The memory keeper: notes conversations, extracts them after a silence, checks, stores and recalls.

Flow (memory.md): every reply is noted in the NPC's pending conversation (on disk before
`note_exchange` returns); when nobody has talked to that NPC for `memory_silence_seconds`, one
extraction call runs at `Priority.EXTRACTION` (replies go first), the checks decide, and the extracted
lines are cleared. One tracked task per NPC waits for its silence and retries failed calls with capped
exponential backoff; `run()` owns those tasks and cancels them together when it is cancelled.

Choices where the spec is silent:
- Memories are dated with the time of the last line of the conversation they came from (not the time
  of the extraction), and the extraction prompt's "today" is that line's date: a conversation left
  over from yesterday is extracted after a restart as what it was, yesterday's.
- A character with `memory.extract: "inline"` keeps no pending conversation: its reply carries its
  memories (`save_inline`), so a silence extraction would only duplicate them.
- A character with `memory.backend: "shared"` puts checked memories in its file's `outbox`; one task
  per NPC hands them to the service in order and removes each once taken (at least once: a crash
  between the two may send one again). Without `NPC_BRIDGE_SHARED_MEMORY_URL` such a character warns
  once and uses its local memory file like any other.
- Duplicates of a shared character are checked against its local memories and its outbox only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
from collections.abc import Callable
from datetime import datetime, tzinfo
from typing import Any

import structlog

from bridge.errors import LLMError, MemoryStoreError
from bridge.llm.base import LLMBackend
from bridge.llm.gate import LLMGate, Priority
from bridge.memory.checks import MemoryRules, check_candidates
from bridge.memory.extractor import EXTRACTION_DEADLINE_SECONDS, extract, extraction_instructions
from bridge.memory.models import (
    SOURCE_EXTRACTION,
    SOURCE_INLINE,
    MemoryFile,
    OutboxItem,
    PendingLine,
)
from bridge.memory.shared import RECALL_LIMIT, SHARED_SOURCE, SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import Roster
from bridge.npc.prompt import format_memory_line
from bridge.settings import Settings

log = structlog.get_logger(__name__)

RETRY_BASE_SECONDS = 5.0
RETRY_CAP_SECONDS = 600.0  # the LAN machine may sleep for hours: keep trying, every 10 minutes at most
RETRY_JITTER = 0.1
MAX_UNPARSEABLE_TRIES = 3
# An NPC that never gets its silence (players queueing at the counter) must not pile up a pending
# conversation that is rewritten on every reply and no longer fits the extraction prompt: at this
# many lines it is extracted without waiting for the silence, this many lines per call.
EXTRACTION_BATCH_LINES = 24
# While the model is unreachable, lines beyond this many are dropped, oldest first, with a log.
MAX_PENDING_LINES = 400
RECALL_TIMEOUT_SECONDS = 5.0  # recall sits on the reply path: a slow service must not eat the deadline


class _Outcome(enum.Enum):
    DONE = "done"  # the pending lines it took are cleared
    RETRY = "retry"  # they stay; try again after a backoff


def backoff_seconds(attempt: int, *, base: float, cap: float) -> float:
    """Exponential backoff with jitter for the `attempt`-th consecutive failure (1-based), capped."""
    delay: float = min(cap, base * 2.0 ** min(attempt - 1, 30))
    return min(cap, delay * random.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER))


def _parse_time(value: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def show_lines(memory: MemoryFile, zone: tzinfo | None) -> list[str]:
    """What `npc-bridge memory show <npc>` prints: memories numbered from 1, then pending lines."""
    lines = [f"{memory.npc_id}: {len(memory.memories)} memories"]
    for number, item in enumerate(memory.memories, start=1):
        local = item.heard_at.astimezone(zone)
        lines.append(f"{number:>3}. ({local:%Y-%m-%d %H:%M}) {item.text}  [{item.source}]")
    if memory.outbox:
        lines.append(f"waiting for the shared memory service: {len(memory.outbox)}")
        for waiting in memory.outbox:
            lines.append(f"     ({waiting.created_at.astimezone(zone):%Y-%m-%d %H:%M}) {waiting.text}")
    lines.append(f"pending conversation: {len(memory.pending)} lines")
    for line in memory.pending:
        when = f"{line.at.astimezone(zone):%Y-%m-%d %H:%M}"
        if line.is_event:
            lines.append(f"     ({when}) npc (event): {line.npc}")
        else:
            lines.append(f"     ({when}) player: {line.player}")
            lines.append(f"     {'':18} npc: {line.npc}")
    return lines


async def forget_by_number(store: MemoryStore, npc_id: str, number: int | None) -> int:
    """`npc-bridge memory forget <npc> [N]`: forget memory N as `show_lines` numbers it, or all."""
    return await store.forget(npc_id, None if number is None else number - 1)


class MemoryKeeper:
    """Per-NPC memory for the dispatcher: note, time the silence, extract, check, store, recall."""

    def __init__(
        self,
        *,
        store: MemoryStore,
        backend: LLMBackend,
        gate: LLMGate,
        roster: Roster,
        settings: Settings,
        shared: SharedMemoryClient | None,
        clock: Callable[[], datetime] | None = None,
        retry_base_seconds: float = RETRY_BASE_SECONDS,
        retry_cap_seconds: float = RETRY_CAP_SECONDS,
        extraction_deadline_seconds: float = EXTRACTION_DEADLINE_SECONDS,
    ) -> None:
        self._store = store
        self._backend = backend
        self._gate = gate
        self._roster = roster
        self._settings = settings
        self._shared = shared
        self._zone = settings.zone()
        self._clock = clock or (lambda: datetime.now(self._zone).astimezone(self._zone))
        self._retry_base = retry_base_seconds
        self._retry_cap = retry_cap_seconds
        self._extraction_deadline = extraction_deadline_seconds
        self._rules = MemoryRules.from_settings(settings, instructions=extraction_instructions(settings.memory_subject))
        self._deadlines: dict[str, float] = {}  # loop time at which each NPC's silence is long enough
        self._backing_off: set[str] = set()  # NPCs whose last extraction failed: their deadline is a backoff
        self._extracting: set[str] = set()  # NPCs with an extraction call in flight
        self._wakes: dict[str, asyncio.Event] = {}  # set when a deadline moves earlier (a batch is due)
        self._unparseable: dict[str, int] = {}
        self._extractors: dict[str, asyncio.Task[None]] = {}
        self._deliveries: dict[str, asyncio.Task[None]] = {}
        self._running = False
        self._warned_unconfigured: set[str] = set()
        # Check-then-store runs one at a time per NPC, so an inline save and an extraction finishing
        # together cannot both pass the duplicate check with the same memory.
        self._keeping: dict[str, asyncio.Lock] = {}

    # --- lifetime ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: extract what a previous run left, then keep every NPC's silence timer."""
        if self._running:
            raise RuntimeError("MemoryKeeper.run is already running")
        self._running = True
        loop = asyncio.get_running_loop()
        try:
            leftover = await self._store.npc_ids_with_pending()
            if leftover:
                log.info("memory_leftover_pending", npc_ids=leftover)
            for npc_id in leftover:
                # Quiet since the last run: extract now unless someone is already talking to it.
                self._deadlines.setdefault(npc_id, loop.time())
            for npc_id in list(self._deadlines):
                self._ensure_extractor(npc_id)
            for npc_id in await self._store.npc_ids_with_outbox():
                self._ensure_delivery(npc_id)
            await asyncio.Event().wait()
        finally:
            self._running = False
            tasks = [*self._extractors.values(), *self._deliveries.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def flush(self, timeout: float) -> None:  # noqa: ASYNC109 - the lead's staged-shutdown budget
        """At shutdown: pending lines are already on disk; wait for writes still in flight."""
        await self._store.flush(timeout)

    # --- noting --------------------------------------------------------------------------------

    async def note_exchange(self, npc_id: str, *, player: str, npc: str, at: datetime) -> None:
        """Note a reply with the player line it answered; on disk when this returns."""
        await self._note(npc_id, PendingLine(player=player, npc=npc, at=_aware(at)))

    async def note_event(self, npc_id: str, *, text: str, at: datetime) -> None:
        """Note an `npc:event` line the world had the NPC say to a player."""
        await self._note(npc_id, PendingLine(player="", npc=text, at=_aware(at)))

    def touch(self, npc_id: str) -> None:
        """A player talked to this NPC: its silence starts again (talk still being answered postpones it)."""
        self._postpone(npc_id)

    async def _note(self, npc_id: str, line: PendingLine) -> None:
        character = self._roster.get(npc_id)
        if character is not None and character.memory.extract == "inline":
            return  # its replies carry their own memories (save_inline)
        self._postpone(npc_id)
        await self._store.append_pending(npc_id, line)
        self._postpone(npc_id)
        pending = len(await self._store.pending(npc_id))
        if pending >= EXTRACTION_BATCH_LINES and npc_id not in self._backing_off:
            # A long conversation is extracted now, in batches, instead of after a silence that
            # may never come.
            self._deadlines[npc_id] = asyncio.get_running_loop().time()
            self._wakes.setdefault(npc_id, asyncio.Event()).set()
        if pending > MAX_PENDING_LINES and npc_id not in self._extracting:
            # Only between extractions: one in flight clears the lines it took by count.
            await self._store.clear_pending(npc_id, pending - MAX_PENDING_LINES)
            log.warning("memory_pending_trimmed", npc=npc_id, dropped=pending - MAX_PENDING_LINES)
        self._ensure_extractor(npc_id)

    def _postpone(self, npc_id: str) -> None:
        # Deadlines only move later: a touch never cuts short a retry backoff already running.
        until = asyncio.get_running_loop().time() + self._settings.memory_silence_seconds
        self._deadlines[npc_id] = max(self._deadlines.get(npc_id, 0.0), until)

    # --- recall --------------------------------------------------------------------------------

    async def recall(self, npc_id: str, *, query: str) -> list[str]:
        """Memory lines for the reply prompt, `- (M/D) text`; [] when there are none or on failure."""
        if self._settings.memory_recall <= 0:
            return []
        shared = self._shared_for(npc_id)
        if shared is not None:
            try:
                async with asyncio.timeout(RECALL_TIMEOUT_SECONDS):
                    found = await shared.recall(query, limit=RECALL_LIMIT)
            except (MemoryStoreError, TimeoutError) as exc:
                log.warning("shared_memory_recall_failed", npc=npc_id, error=type(exc).__name__)
                return []
            return [
                format_memory_line(item.text, _parse_time(item.created_at), self._zone)
                for item in found
                if item.text.strip()
            ]
        try:
            recent = await self._store.recent(npc_id, self._settings.memory_recall)
        except MemoryStoreError as exc:
            log.error("memory_recall_failed", npc=npc_id, error=str(exc))
            return []
        return [format_memory_line(item.text, item.heard_at, self._zone) for item in recent]

    # --- keeping -------------------------------------------------------------------------------

    async def save_inline(self, npc_id: str, lines: list[str], *, at: datetime) -> list[str]:
        """Memories a strong model wrote in its reply: the same checks, then stored; returns those kept."""
        async with self._keeping.setdefault(npc_id, asyncio.Lock()):
            texts = await self._check(npc_id, list(lines))
            await self._store_kept(npc_id, texts, heard_at=_aware(at), source=SOURCE_INLINE, taken=0)
        return texts

    async def _check(self, npc_id: str, candidates: list[object]) -> list[str]:
        current = await self._store.load(npc_id)
        known = [item.text for item in current.memories] + [item.text for item in current.outbox]
        texts, rejections = check_candidates(candidates, kept=known, rules=self._rules)
        for rejection in rejections:
            log.info("memory_rejected", npc=npc_id, rule=rejection.rule, **self._content(rejection.text))
        return texts

    async def _store_kept(self, npc_id: str, texts: list[str], *, heard_at: datetime, source: str, taken: int) -> None:
        """Store what passed the checks and clear the `taken` pending lines, in one write."""
        shared = self._shared_for(npc_id) is not None
        if shared:
            items = [OutboxItem(text=text, created_at=heard_at, source=SHARED_SOURCE) for text in texts]
            await self._store.record_extraction(npc_id, taken=taken, outbox=items)
            if items:
                self._ensure_delivery(npc_id)
        else:
            await self._store.record_extraction(npc_id, taken=taken, texts=texts, heard_at=heard_at, source=source)
        for text in texts:
            log.info(
                "memory_kept",
                npc=npc_id,
                source=source,
                backend="shared" if shared else "file",
                **self._content(text),
            )

    def _shared_for(self, npc_id: str) -> SharedMemoryClient | None:
        """The shared service when this NPC uses one; None: its local memory file."""
        character = self._roster.get(npc_id)
        if character is None or character.memory.backend != "shared":
            return None
        if self._shared is None:
            if npc_id not in self._warned_unconfigured:
                self._warned_unconfigured.add(npc_id)
                log.warning(
                    "shared_memory_unconfigured",
                    npc=npc_id,
                    detail="NPC_BRIDGE_SHARED_MEMORY_URL is not set: using the local memory file",
                )
            return None
        return self._shared

    def _content(self, text: object) -> dict[str, Any]:
        return {"text": text} if self._settings.log_content else {}

    # --- the silence timer and the extraction ----------------------------------------------------

    def _ensure_extractor(self, npc_id: str) -> None:
        if not self._running:
            return  # run() starts it; the pending lines wait on disk meanwhile
        task = self._extractors.get(npc_id)
        if task is None or task.done():
            self._extractors[npc_id] = asyncio.create_task(self._extractor(npc_id), name=f"memory-extract-{npc_id}")

    async def _extractor(self, npc_id: str) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        try:
            while True:
                await self._silence(npc_id)
                try:
                    outcome = await self._extract_once(npc_id)
                except (LLMError, TimeoutError, MemoryStoreError) as exc:
                    log.warning(
                        "memory_extraction_failed",
                        npc=npc_id,
                        error=type(exc).__name__,
                        detail=str(exc)[:200],
                        attempt=failures + 1,
                    )
                    outcome = _Outcome.RETRY
                except Exception:  # a bug: logged with its traceback, and the lines stay for a later try
                    log.exception("memory_extraction_crashed", npc=npc_id)
                    outcome = _Outcome.RETRY
                if outcome is _Outcome.RETRY:
                    self._backing_off.add(npc_id)
                    failures += 1
                    delay = backoff_seconds(failures, base=self._retry_base, cap=self._retry_cap)
                    self._deadlines[npc_id] = max(self._deadlines.get(npc_id, 0.0), loop.time() + delay)
                    log.info("memory_extraction_retry", npc=npc_id, in_seconds=round(delay, 1))
                    continue
                failures = 0
                self._backing_off.discard(npc_id)
                # No await between this check and leaving: a line noted later starts a new task.
                if not await self._store.pending(npc_id):
                    return
        finally:
            if self._extractors.get(npc_id) is asyncio.current_task():
                del self._extractors[npc_id]

    async def _silence(self, npc_id: str) -> None:
        loop = asyncio.get_running_loop()
        # Deadlines move later (more talk), or to now when a batch is due (which sets the wake).
        wake = self._wakes.setdefault(npc_id, asyncio.Event())
        while (remaining := self._deadlines.get(npc_id, 0.0) - loop.time()) > 0:
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), remaining)

    async def _extract_once(self, npc_id: str) -> _Outcome:
        self._extracting.add(npc_id)
        try:
            return await self._extract_batch(npc_id)
        finally:
            self._extracting.discard(npc_id)

    async def _extract_batch(self, npc_id: str) -> _Outcome:
        """One extraction call over the oldest pending lines (at most EXTRACTION_BATCH_LINES)."""
        lines = (await self._store.pending(npc_id))[:EXTRACTION_BATCH_LINES]
        if not lines:
            return _Outcome.DONE
        taken = len(lines)
        heard_at = lines[-1].at
        character = self._roster.get(npc_id)
        model = (character.llm.model if character else None) or self._settings.llm_model
        lane = character.llm.lane if character else None
        async with self._gate.slot(Priority.EXTRACTION):
            log.info("memory_extraction_started", npc=npc_id, lines=taken)
            candidates = await extract(
                self._backend,
                lines,
                model=model,
                lane=lane,
                today=heard_at.astimezone(self._zone).date(),
                subject=self._settings.memory_subject,
                deadline_seconds=self._extraction_deadline,
            )
        if candidates is None:
            tries = self._unparseable[npc_id] = self._unparseable.get(npc_id, 0) + 1
            if tries < MAX_UNPARSEABLE_TRIES:
                log.warning("memory_extraction_unparseable", npc=npc_id, tries=tries)
                return _Outcome.RETRY
            await self._store.clear_pending(npc_id, taken)
            self._unparseable.pop(npc_id, None)
            log.warning("memory_pending_dropped", npc=npc_id, lines=taken, tries=tries, reason="unparseable")
            return _Outcome.DONE
        self._unparseable.pop(npc_id, None)
        async with self._keeping.setdefault(npc_id, asyncio.Lock()):
            kept = await self._check(npc_id, candidates)
            await self._store_kept(npc_id, kept, heard_at=heard_at, source=SOURCE_EXTRACTION, taken=taken)
        log.info("memory_extracted", npc=npc_id, lines=taken, candidates=len(candidates), kept=len(kept))
        return _Outcome.DONE

    # --- the shared service's outbox -----------------------------------------------------------

    def _ensure_delivery(self, npc_id: str) -> None:
        if not self._running or self._shared is None:
            return
        task = self._deliveries.get(npc_id)
        if task is None or task.done():
            self._deliveries[npc_id] = asyncio.create_task(
                self._deliver(npc_id, self._shared), name=f"memory-deliver-{npc_id}"
            )

    async def _deliver(self, npc_id: str, shared: SharedMemoryClient) -> None:
        failures = 0
        try:
            while True:
                # No await between this check and leaving: a memory queued later starts a new task.
                waiting = await self._store.outbox(npc_id)
                if not waiting:
                    return
                first = waiting[0]
                try:
                    await shared.save(first.text, first.created_at, first.source)
                except Exception as exc:
                    failures += 1
                    delay = backoff_seconds(failures, base=self._retry_base, cap=self._retry_cap)
                    if isinstance(exc, MemoryStoreError):
                        log.warning(
                            "shared_memory_save_failed",
                            npc=npc_id,
                            error=type(exc).__name__,
                            detail=str(exc)[:200],
                            waiting=len(waiting),
                            retry_in_seconds=round(delay, 1),
                        )
                    else:  # a bug: logged with its traceback; the memory stays queued
                        log.exception("shared_memory_save_crashed", npc=npc_id)
                    await asyncio.sleep(delay)
                    continue
                # Only this task removes from the outbox, and only from its head: that is `first`.
                await self._store.remove_outbox(npc_id, 1)
                failures = 0
                log.info("shared_memory_saved", npc=npc_id, **self._content(first.text))
        finally:
            if self._deliveries.get(npc_id) is asyncio.current_task():
                del self._deliveries[npc_id]


def _aware(moment: datetime) -> datetime:
    # A naive time is taken as the system's local time rather than refused.
    return moment if moment.tzinfo is not None else moment.astimezone()
