"""The memory keeper: notes conversations, extracts them after a silence, checks, stores and recalls.

Flow (memory.md): every reply is noted in the NPC's pending conversation (on disk before
`note_exchange` returns while the disk takes writes; see `bridge.memory.store` for a failing disk);
when nobody has talked to that NPC for `memory_silence_seconds`, one extraction call runs at
`Priority.EXTRACTION` (replies go first), the checks decide, and the extracted lines are cleared.
One tracked task per NPC waits for its silence and retries failed calls with capped exponential
backoff; `run()` owns those tasks and cancels them together when it is cancelled. Each NPC's timer
and extraction state is one `_NpcMemory`, let go when idle (`bridge.memory.active`).

Choices where the spec is silent:
- Memories are dated with the time of the last line of the conversation they came from (not the time
  of the extraction), and the extraction prompt's "today" is that line's date: a conversation left
  over from yesterday is extracted after a restart as what it was, yesterday's.
- A character with `memory.extract: "inline"` keeps no pending conversation: its reply carries its
  memories (`save_inline`), so a silence extraction would only duplicate them.
- A character with `memory.backend: "shared"` puts checked memories in its file's `outbox`; one task
  per NPC hands them to the service in order and removes each once taken (`OutboxCourier`). Without
  `NPC_BRIDGE_SHARED_MEMORY_URL` such a character warns (once while it is active) and uses its local
  memory file like any other.
- Duplicates of a shared character are checked against its local memories and its outbox only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from bridge.backoff import Backoff
from bridge.errors import LLMError, MemoryStoreError
from bridge.llm.base import LLMBackend
from bridge.llm.gate import LLMGate, Priority
from bridge.memory.active import IDLE_SECONDS, ActiveTable
from bridge.memory.character import Characters
from bridge.memory.checks import Kept, MemoryRules, decide
from bridge.memory.extractor import EXTRACTION_DEADLINE_SECONDS, extract, extraction_instructions
from bridge.memory.models import SOURCE_EXTRACTION, SOURCE_INLINE, OutboxItem, PendingLine
from bridge.memory.recall import Recalled, in_zone, recall
from bridge.memory.shared import RECALL_LIMIT, SHARED_SOURCE, OutboxCourier, SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.settings import Settings

log = structlog.get_logger(__name__)

RETRY_BASE_SECONDS = 5.0
RETRY_CAP_SECONDS = 600.0  # the LAN machine may sleep for hours: keep trying, every 10 minutes at most
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


@dataclass(eq=False)
class _NpcMemory:
    """One NPC's silence timer and extraction state."""

    deadline: float = 0.0  # loop time at which its silence is long enough (or its retry is due)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set when a batch is due at once
    backing_off: bool = False  # its last extraction failed: the deadline is a backoff
    extracting: bool = False  # an extraction call is in flight
    unparseable: int = 0  # answers in a row with no parseable object
    extractor: asyncio.Task[None] | None = None
    # Check-then-store runs one at a time per NPC, so an inline save and an extraction finishing
    # together cannot both pass the duplicate check with the same memory.
    keeping: asyncio.Lock = field(default_factory=asyncio.Lock)
    warned_unconfigured: bool = False

    def postpone(self, until: float) -> None:
        # Deadlines only move later: a touch never cuts short a retry backoff already running.
        self.deadline = max(self.deadline, until)

    def busy(self) -> bool:
        """A timer or an extraction still runs (or a save holds the lock): never let go."""
        running = self.extractor is not None and not self.extractor.done()
        return running or self.extracting or self.keeping.locked()


class MemoryKeeper:
    """Per-NPC memory for the dispatcher: note, time the silence, extract, check, store, recall."""

    def __init__(
        self,
        *,
        store: MemoryStore,
        backend: LLMBackend,
        gate: LLMGate,
        roster: Characters,
        settings: Settings,
        shared: SharedMemoryClient | None,
        clock: Callable[[], datetime] | None = None,
        retry_base_seconds: float = RETRY_BASE_SECONDS,
        retry_cap_seconds: float = RETRY_CAP_SECONDS,
        extraction_deadline_seconds: float = EXTRACTION_DEADLINE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._backend = backend
        self._gate = gate
        self._roster = roster
        self._settings = settings
        self._shared = shared
        self._zone = settings.zone()
        self._clock = clock or (lambda: datetime.now(self._zone).astimezone(self._zone))
        self._backoff = functools.partial(Backoff, base_seconds=retry_base_seconds, cap_seconds=retry_cap_seconds)
        self._extraction_deadline = extraction_deadline_seconds
        self._rules = MemoryRules.from_settings(settings, instructions=extraction_instructions(settings.memory_subject))
        self._npcs: ActiveTable[_NpcMemory] = ActiveTable(_NpcMemory.busy, idle_seconds=idle_seconds, clock=monotonic)
        self._courier = (
            OutboxCourier(store, shared, backoff=self._backoff)
            if shared is not None
            else None
        )
        self._running = False

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
                if self._npcs.peek(npc_id) is None:
                    self._state(npc_id).deadline = loop.time()
            for npc_id in self._npcs:
                if (await self._store.load(npc_id)).pending:  # noted before run(): its timer starts now
                    self._ensure_extractor(npc_id)
            if self._courier is not None:
                for npc_id in await self._store.npc_ids_with_outbox():
                    self._courier.ensure(npc_id)
            await asyncio.Event().wait()
        finally:
            self._running = False
            tasks = [state.extractor for state in self._npcs.values() if state.extractor is not None]
            if self._courier is not None:
                tasks.extend(self._courier.stop())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def flush(self, timeout: float) -> None:  # noqa: ASYNC109 - the caller's staged-shutdown budget
        """At shutdown: wait for writes in flight, or waiting for a disk that refused them."""
        await self._store.flush(timeout)

    def _state(self, npc_id: str) -> _NpcMemory:
        return self._npcs.find(npc_id) or self._npcs.add(npc_id, _NpcMemory())

    # --- noting --------------------------------------------------------------------------------

    async def note_exchange(self, npc_id: str, *, player: str, npc: str, at: datetime) -> None:
        """Note a reply with the player line it answered; on disk when this returns (only in RAM,
        written later, while the disk refuses writes)."""
        await self._note(npc_id, PendingLine(player=player, npc=npc, at=_aware(at)))

    async def note_event(self, npc_id: str, *, text: str, at: datetime) -> None:
        """Note an `npc:event` line the world had the NPC say to a player."""
        await self._note(npc_id, PendingLine(player="", npc=text, at=_aware(at)))

    def touch(self, npc_id: str) -> None:
        """A player talked to this NPC: its silence starts again (talk still being answered postpones it)."""
        loop = asyncio.get_running_loop()
        self._state(npc_id).postpone(loop.time() + self._settings.memory_silence_seconds)

    async def _note(self, npc_id: str, line: PendingLine) -> None:
        character = self._roster.get(npc_id)
        if character is not None and character.memory.extract == "inline":
            return  # its replies carry their own memories (save_inline)
        self.touch(npc_id)
        await self._store.append_pending(npc_id, line)
        self.touch(npc_id)
        state = self._state(npc_id)
        pending = len((await self._store.load(npc_id)).pending)
        if pending >= EXTRACTION_BATCH_LINES and not state.backing_off:
            # A long conversation is extracted now, in batches, instead of after a silence that
            # may never come.
            state.deadline = asyncio.get_running_loop().time()
            state.wake.set()
        if pending > MAX_PENDING_LINES and not state.extracting:
            # Only between extractions: one in flight clears the lines it took by count.
            await self._store.clear_pending(npc_id, pending - MAX_PENDING_LINES)
            log.warning("memory_pending_trimmed", npc=npc_id, dropped=pending - MAX_PENDING_LINES)
        self._ensure_extractor(npc_id)

    # --- recall --------------------------------------------------------------------------------

    async def recall(self, npc_id: str, *, query: str, previous: str | None = None) -> list[Recalled]:
        """Memories for the prompt (`recall.recall`; a shared NPC's: the service's, each "relevant"), oldest
        first, dated in the configured zone; [] on failure. `previous`: the player's line before `query`."""
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
            items = [Recalled(item.text, _parse_time(item.created_at), "relevant") for item in found]
            return [in_zone(item, self._zone) for item in items if item.text.strip()]
        try:
            memories = (await self._store.load(npc_id)).memories
        except MemoryStoreError as exc:
            log.error("memory_recall_failed", npc=npc_id, error=str(exc))
            return []
        character, settings = self._roster.get(npc_id), self._settings
        language = character.speech.language if character else "ja"
        return recall(
            memories, [query, previous or ""], limit=settings.memory_recall, recent=settings.memory_recall_recent,
            subject=settings.memory_subject, language=language, zone=self._zone,
        )

    # --- keeping -------------------------------------------------------------------------------

    async def save_inline(self, npc_id: str, lines: list[str], *, at: datetime) -> list[str]:
        """Memories a strong model wrote in its reply: the same checks, then stored; returns those kept."""
        return await self._keep(npc_id, list(lines), heard_at=_aware(at), source=SOURCE_INLINE, taken=0)

    async def _keep(
        self, npc_id: str, candidates: list[object], *, heard_at: datetime, source: str, taken: int
    ) -> list[str]:
        """Check the candidates, then store those that passed and clear the `taken` pending lines in
        one write; returns the texts kept (refreshes and replacements included)."""
        async with self._state(npc_id).keeping:
            current = await self._store.load(npc_id)
            known = [item.text for item in current.memories] + [item.text for item in current.outbox]
            shared = self._shared_for(npc_id) is not None
            # Said again (refresh, replace) changes the memory file; a shared NPC's memories live in
            # the service, so there a match with what it knows stays a duplicate.
            kept, rejections = decide(candidates, stored=known, rules=self._rules, said_again=not shared)
            for rejection in rejections:
                log.info("memory_rejected", npc=npc_id, rule=rejection.rule, text=rejection.text)
            if shared:
                items = [OutboxItem(text=item.text, created_at=heard_at, source=SHARED_SOURCE) for item in kept]
                await self._store.record_extraction(npc_id, taken=taken, outbox=items)
                if items and self._courier is not None and self._running:
                    self._courier.ensure(npc_id)
            else:
                await self._store.record_extraction(npc_id, taken=taken, kept=kept, heard_at=heard_at, source=source)
        for item in kept:
            _log_kept(npc_id, item, source=source, backend="shared" if shared else "file")
        return [item.text for item in kept]

    def _shared_for(self, npc_id: str) -> SharedMemoryClient | None:
        """The shared service when this NPC uses one; None: its local memory file."""
        character = self._roster.get(npc_id)
        if character is None or character.memory.backend != "shared":
            return None
        if self._shared is None:
            state = self._state(npc_id)
            if not state.warned_unconfigured:
                state.warned_unconfigured = True
                log.warning(
                    "shared_memory_unconfigured",
                    npc=npc_id,
                    detail="NPC_BRIDGE_SHARED_MEMORY_URL is not set: using the local memory file",
                )
            return None
        return self._shared

    # --- the silence timer and the extraction ----------------------------------------------------

    def _ensure_extractor(self, npc_id: str) -> None:
        if not self._running:
            return  # run() starts it; the pending lines wait on disk meanwhile
        state = self._state(npc_id)
        if state.extractor is None or state.extractor.done():
            state.extractor = asyncio.create_task(self._extractor(npc_id, state), name=f"memory-extract-{npc_id}")

    async def _extractor(self, npc_id: str, state: _NpcMemory) -> None:
        loop = asyncio.get_running_loop()
        backoff = self._backoff()
        while True:
            # Deadlines move later (more talk), or to now when a batch is due (which sets the wake).
            while (remaining := state.deadline - loop.time()) > 0:
                state.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(state.wake.wait(), remaining)
            try:
                state.extracting = True
                outcome = await self._extract_batch(npc_id, state)
            except (LLMError, TimeoutError, MemoryStoreError) as exc:
                log.warning(
                    "memory_extraction_failed",
                    npc=npc_id,
                    error=type(exc).__name__,
                    detail=str(exc)[:200],
                    attempt=backoff.attempt + 1,
                )
                outcome = _Outcome.RETRY
            except Exception:  # a bug: logged with its traceback, and the lines stay for a later try
                log.exception("memory_extraction_crashed", npc=npc_id)
                outcome = _Outcome.RETRY
            finally:
                state.extracting = False
            if outcome is _Outcome.RETRY:
                state.backing_off = True
                delay = backoff.next_delay()
                state.postpone(loop.time() + delay)
                log.info("memory_extraction_retry", npc=npc_id, in_seconds=round(delay, 1))
                continue
            backoff.reset()
            state.backing_off = False
            # No await between this check and leaving: a line noted later starts a new task.
            if not (await self._store.load(npc_id)).pending:
                return

    async def _extract_batch(self, npc_id: str, state: _NpcMemory) -> _Outcome:
        """One extraction call over the oldest pending lines (at most EXTRACTION_BATCH_LINES)."""
        lines = ((await self._store.load(npc_id)).pending)[:EXTRACTION_BATCH_LINES]
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
            state.unparseable += 1
            if state.unparseable < MAX_UNPARSEABLE_TRIES:
                log.warning("memory_extraction_unparseable", npc=npc_id, tries=state.unparseable)
                return _Outcome.RETRY
            await self._store.clear_pending(npc_id, taken)
            log.warning(
                "memory_pending_dropped", npc=npc_id, lines=taken, tries=state.unparseable, reason="unparseable"
            )
            state.unparseable = 0
            return _Outcome.DONE
        state.unparseable = 0
        kept = await self._keep(npc_id, candidates, heard_at=heard_at, source=SOURCE_EXTRACTION, taken=taken)
        log.info("memory_extracted", npc=npc_id, lines=taken, candidates=len(candidates), kept=len(kept))
        return _Outcome.DONE


def _log_kept(npc_id: str, item: Kept, *, source: str, backend: str) -> None:
    # Texts go under content keys: the log filter (bridge.logs) drops them unless content logging is on.
    if item.refreshes is not None:
        log.info("memory_refreshed", npc=npc_id, source=source, text=item.refreshes)
    for old in item.replaces:
        log.info("memory_replaced", npc=npc_id, source=source, text=item.text, replaced=old)
    if item.refreshes is None and not item.replaces:
        log.info("memory_kept", npc=npc_id, source=source, backend=backend, text=item.text)


def _parse_time(value: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None



def _aware(moment: datetime) -> datetime:
    # A naive time is taken as the system's local time rather than refused.
    return moment if moment.tzinfo is not None else moment.astimezone()
