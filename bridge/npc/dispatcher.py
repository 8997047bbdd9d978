"""World events → one queue per NPC → replies, with the queueing rules of replies.md.

An NPC answers one line at a time, in order. A line is *queued* until its request is sent to the
LLM (waiting for the NPC or for the LLM slot both count); while queued, a newer line from the same
player to the same NPC replaces it, and `player:left` drops it — neither gets an `npc:say`. A line
already sent to the LLM is always answered: with the reply, or with a fallback line.

The reply deadline counts from the moment a line reached the bridge (`handle`), queue time
included: each line carries one `Deadline` from its arrival. A line whose deadline passed before
its request went to the LLM (waiting for the NPC, the recall, or the LLM slot) is answered with a
fallback at once and never sent; one sent to the LLM gets only what is left. Deadlines follow the
arrival order of an NPC's queue, so a line never waits past its own deadline behind an earlier one.

When the world wants parts (`Speaker.parts_wanted`, read as the LLM request starts), each final,
checked sentence goes out as `npc:say:part` before the line's one `npc:say`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import structlog

from bridge.llm.gate import LLMGate
from bridge.memory.recall import Recalled, recall_fields
from bridge.npc.characters import Character, Roster
from bridge.npc.conversation import Conversations
from bridge.npc.deadline import Deadline
from bridge.npc.parts import PartSink
from bridge.npc.prompt import sanitize_player_text
from bridge.npc.responder import Reply, Responder
from bridge.npc.turns import Memory, ReplyPath, Turn
from bridge.speech import Emotion
from bridge.world.messages import NpcEvent, PlayerLeft, Say, SayPart, Talk, Typing

log = structlog.get_logger(__name__)

MAX_QUEUED_LINES_PER_NPC = 16
SHUTDOWN_GRACE_SECONDS = 5.0


class Speaker(Protocol):
    """The world link's mouth."""

    @property
    def parts_wanted(self) -> bool:
        """Whether the connected world wants `npc:say:part` now (it offered `say-parts`, not turned off)."""
        ...

    async def say(self, message: Say) -> None: ...

    async def say_part(self, message: SayPart) -> None: ...

    async def typing(self, message: Typing) -> None: ...


@dataclass(eq=False)
class _Line:
    talk: Talk
    text: str  # sanitised player text
    received: float  # time.monotonic() when it reached the bridge
    deadline: Deadline  # the reply deadline, from `received`
    dropped: bool = False
    sent: bool = False  # its request went to the LLM: it will be answered
    recalled: Sequence[Recalled] = ()  # the memories its prompt holds, for the reply's log line
    parts: list[SayPart] = field(default_factory=list)  # the npc:say:part sent for it


@dataclass(eq=False)
class _NpcQueue:
    character: Character
    lines: deque[_Line] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    current: _Line | None = None
    # The latest exchange being written to memory: the next one waits for it, so the pending
    # conversation keeps its order, while the NPC already works on its next line.
    noting: asyncio.Task[None] | None = None

    def note_later(self, write: Callable[[], Awaitable[None]], tracked: set[asyncio.Task[None]]) -> None:
        """Write to the NPC's pending conversation after the previous note, while the NPC goes on;
        the task is kept in `tracked` until it ends (shutdown waits for them)."""
        npc_id = self.character.id
        self.noting = asyncio.create_task(_note(self.noting, npc_id, write), name=f"note:{npc_id}")
        tracked.add(self.noting)
        self.noting.add_done_callback(tracked.discard)


async def _note(previous: asyncio.Task[None] | None, npc_id: str, write: Callable[[], Awaitable[None]]) -> None:
    if previous is not None:
        await asyncio.wait({previous})  # its own errors are its own: only the order matters here
    try:
        await write()
    except Exception:
        log.exception("memory_note_failed", npc=npc_id)


class Dispatcher:
    def __init__(
        self,
        *,
        roster: Roster,
        speaker: Speaker,
        responder: Responder,
        gate: LLMGate,
        memory: Memory,
        conversations: Conversations,
        reply_deadline_seconds: float,
    ) -> None:
        self._speaker = speaker
        self._responder = responder
        self._path = ReplyPath(responder=responder, gate=gate, memory=memory, conversations=conversations)
        self._conversations = conversations
        self._deadline_seconds = reply_deadline_seconds
        self._queues = {npc_id: _NpcQueue(character) for npc_id, character in roster.voiced.items()}
        self._closing = False
        self._group: asyncio.TaskGroup | None = None  # while run() runs: new NPCs' workers join it
        self._notes: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- events in -------------------------------------------------------------------------------

    def handle(self, event: Talk | NpcEvent | PlayerLeft) -> None:
        """Take one world event; never waits (the world link's next frame is not held up)."""
        if isinstance(event, Talk):
            self._take_talk(event)
        elif isinstance(event, NpcEvent):
            self._take_world_line(event)
        else:
            self._player_left(event.player_id)

    def _take_talk(self, talk: Talk) -> None:
        queue = self._queues.get(talk.npc_id)
        if queue is None:
            log.warning("talk_ignored", reason="npc not voiced", npc=talk.npc_id, event_id=talk.id)
            return
        if self._closing:
            log.info("talk_ignored", reason="shutting down", npc=talk.npc_id, event_id=talk.id)
            return
        now = time.monotonic()
        line = _Line(
            talk=talk,
            text=sanitize_player_text(talk.text),
            received=now,
            deadline=Deadline.after(self._deadline_seconds, since=now),
        )
        for old in [old for old in queue.lines if old.talk.player_id == talk.player_id]:
            queue.lines.remove(old)
            self._drop(old, "superseded", by=talk.id)
        current = queue.current
        if current is not None and not current.sent and current.talk.player_id == talk.player_id:
            self._drop(current, "superseded", by=talk.id)
        if len(queue.lines) >= MAX_QUEUED_LINES_PER_NPC:
            self._drop(queue.lines.popleft(), "queue full")
        queue.lines.append(line)
        queue.wake.set()
        self._path.memory.touch(talk.npc_id)
        log.info(
            "talk_queued",
            npc=talk.npc_id,
            player=talk.player_id,
            event_id=talk.id,
            queued=len(queue.lines),
            player_text=line.text,
        )

    def _take_world_line(self, event: NpcEvent) -> None:
        queue = self._queues.get(event.npc_id)
        if queue is None:
            return
        self._conversations.note_world_line(event.npc_id, event.player_id, event.text)
        if event.player_id is not None:
            # Written in the NPC's note order, not awaited here: a memory write (an fsync) would hold
            # up every talk behind this event.
            npc_id, text, at = event.npc_id, event.text, _from_ms(event.at)
            queue.note_later(lambda: self._path.memory.note_event(npc_id, text=text, at=at), self._notes)

    def _player_left(self, player_id: str) -> None:
        for queue in self._queues.values():
            for line in [line for line in queue.lines if line.talk.player_id == player_id]:
                queue.lines.remove(line)
                self._drop(line, "player left")
            current = queue.current
            if current is not None and not current.sent and current.talk.player_id == player_id:
                self._drop(current, "player left")
        self._conversations.end_player(player_id)

    def _drop(self, line: _Line, reason: str, by: str | None = None) -> None:
        line.dropped = True
        log.info(
            "talk_dropped",
            reason=reason,
            npc=line.talk.npc_id,
            player=line.talk.player_id,
            event_id=line.talk.id,
            superseded_by=by,
        )

    # ---- workers ---------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for npc_id, queue in self._queues.items():
                    group.create_task(self._work(queue), name=f"npc:{npc_id}")
        finally:
            self._group = None

    def voice(self, characters: Mapping[str, Character]) -> None:
        """After a reload: each NPC's reply uses its new character; a newly voiced NPC gets a worker."""
        for npc_id, character in characters.items():
            queue = self._queues.get(npc_id)
            if queue is not None:
                queue.character = character
                continue
            queue = self._queues[npc_id] = _NpcQueue(character)
            if self._group is not None:
                self._group.create_task(self._work(queue), name=f"npc:{npc_id}")

    async def _work(self, queue: _NpcQueue) -> None:
        while True:
            while not queue.lines:
                queue.wake.clear()
                await queue.wake.wait()
            line = queue.lines.popleft()
            queue.current = line
            self._idle.clear()
            try:
                await self._answer(queue, line)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in one reply must not silence the NPC: log it whole and move on.
                log.exception("reply_crashed", npc=line.talk.npc_id, event_id=line.talk.id)
                if line.sent:
                    fallback = self._responder.fallback(queue.character, error="bug")
                    await self._say(queue, line, _said_so_far(line) or fallback)
            finally:
                queue.current = None
                if all(q.current is None for q in self._queues.values()):
                    self._idle.set()

    async def _answer(self, queue: _NpcQueue, line: _Line) -> None:
        talk, deadline = line.talk, line.deadline
        structlog.contextvars.bind_contextvars(npc=talk.npc_id, player=talk.player_id, event_id=talk.id)
        try:
            started = time.monotonic()
            if deadline.passed:
                # It waited its whole deadline for the NPC: answered now, never sent to the LLM.
                log.warning("reply_deadline_passed", where="queued", deadline_s=self._deadline_seconds)
                line.sent = True
                fallback = self._responder.fallback(queue.character, error="deadline")
                await self._say(queue, line, fallback, started=started)
                return
            await self._speaker.typing(Typing(npc_id=talk.npc_id, reply_to=talk.id, on=True))
            waited: list[float] = []

            def sending() -> bool:
                if line.dropped or self._closing:
                    return False
                line.sent = True
                waited.append((time.monotonic() - started) * 1000)
                return True

            def parts() -> PartSink | None:
                return _part_sender(self._speaker, line) if self._speaker.parts_wanted else None

            def recalled(items: Sequence[Recalled]) -> None:
                line.recalled = items

            reply = await self._path.answer(
                _turn(queue.character, line), parts=parts, sending=sending, on_recall=recalled
            )
            if reply is None:
                await self._give_up(line)
                return
            await self._say(queue, line, reply, started=started, waited_ms=waited[0] if waited else 0.0)
        finally:
            structlog.contextvars.unbind_contextvars("npc", "player", "event_id")

    async def _give_up(self, line: _Line) -> None:
        """A line dropped before its request went out: typing off, no say."""
        if not line.dropped:
            self._drop(line, "shutting down")
        await self._speaker.typing(Typing(npc_id=line.talk.npc_id, reply_to=line.talk.id, on=False))

    async def _say(
        self,
        queue: _NpcQueue,
        line: _Line,
        reply: Reply,
        *,
        started: float | None = None,
        waited_ms: float = 0.0,
    ) -> None:
        talk = line.talk
        await self._speaker.say(
            Say(npc_id=talk.npc_id, reply_to=talk.id, text=reply.text, emotion=reply.emotion, source=reply.source)
        )
        write_memory = self._path.note(_turn(queue.character, line), reply)
        stats = reply.stats
        log.info(
            "reply_said",
            npc=talk.npc_id,
            player=talk.player_id,
            event_id=talk.id,
            source=reply.source,
            emotion=reply.emotion,
            latency_ms=round((time.monotonic() - (started or line.received)) * 1000, 1),
            queued_ms=round(((started or line.received) - line.received) * 1000, 1),
            since_arrival_ms=round((time.monotonic() - line.received) * 1000, 1),
            slot_wait_ms=round(waited_ms, 1),
            model=stats.model if stats else None,
            backend=stats.backend if stats else None,
            eval_count=stats.eval_count if stats else None,
            prompt_eval_count=stats.prompt_eval_count if stats else None,
            llm_total_ms=stats.total_duration_ms if stats else None,
            stopped_early=reply.stopped_early,
            parts=len(reply.parts),
            first_part_ms=reply.first_part_ms,
            cut_rule=reply.cut_rule,
            failed_rules=reply.failed_rules or None,
            error=reply.error,
            chars=len(reply.text),
            **recall_fields(line.recalled),
            player_text=line.text,
            npc_text=reply.text,
        )
        queue.note_later(write_memory, self._notes)

    # ---- shutdown --------------------------------------------------------------------------------

    def close(self) -> None:
        """Take no new work: queued lines are dropped (never sent to the LLM, so never owed a say)."""
        self._closing = True
        for queue in self._queues.values():
            while queue.lines:
                self._drop(queue.lines.popleft(), "shutting down")

    async def drain(self, grace_seconds: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Let replies in flight finish within the grace; past it they are answered with a fallback."""
        self.close()
        for queue in self._queues.values():
            if queue.current is not None:
                queue.current.deadline.shorten(grace_seconds)
        try:
            async with asyncio.timeout(grace_seconds + 2.0):
                await self._idle.wait()
                # The last exchanges go to the memory files before the daemon leaves.
                if self._notes:
                    await asyncio.wait(set(self._notes))
        except TimeoutError:
            log.warning("shutdown_replies_unfinished")


def _turn(character: Character, line: _Line) -> Turn:
    talk = line.talk
    return Turn(character, talk.player_id, talk.player_name, line.text, line.deadline)


def _part_sender(speaker: Speaker, line: _Line) -> PartSink:
    """Sends each part of `line`'s reply as `npc:say:part`, and keeps what was sent."""
    talk = line.talk

    async def send(index: int, text: str, emotion: Emotion) -> None:
        part = SayPart(npc_id=talk.npc_id, reply_to=talk.id, index=index, text=text, emotion=emotion)
        await speaker.say_part(part)
        line.parts.append(part)

    return send


def _said_so_far(line: _Line) -> Reply | None:
    """After a bug: the line its parts already said (never taken back), if any."""
    if not line.parts:
        return None
    texts = [part.text for part in line.parts]
    return Reply("".join(texts), line.parts[0].emotion, "generated", error="bug", parts=texts)


def _from_ms(epoch_ms: float) -> datetime:
    try:
        return datetime.fromtimestamp(epoch_ms / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.fromtimestamp(time.time(), UTC)
