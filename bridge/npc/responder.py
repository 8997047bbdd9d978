"""One reply: prompt → LLM stream (stopped once enough is said) → cleaner → checks → regenerate or fall back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import structlog

from bridge.errors import LLMError
from bridge.llm.base import TEMPLATE_STOP_STRINGS, Done, GenerationRequest, GenerationStats, LLMBackend
from bridge.npc.characters import Character, Roster
from bridge.npc.checks import check_reply, regeneration_hint
from bridge.npc.cleaner import clean
from bridge.npc.prompt import Exchange, build_reply_messages, system_message
from bridge.npc.streaming import has_enough, split_inline_memory
from bridge.settings import Settings
from bridge.speech import Emotion, ReplySource

log = structlog.get_logger(__name__)

REPLY_TEMPERATURE = 0.7
REPLY_MAX_TOKENS = 120
# A strong model writing `<memory>` lines after its reply needs room for them.
INLINE_REPLY_MAX_TOKENS = 240
# Small models go on to write the next turn; a newline followed by a speaker label is a cut point.
TURN_STOP_STRINGS = ("\nユーザー", "\nUser:")


@dataclass(frozen=True)
class ReplyContext:
    """Everything a reply depends on, gathered by the caller before the LLM slot is taken."""

    character: Character
    player_line: str  # already sanitised (prompt.sanitize_player_text)
    player_name: str
    world_lines: Sequence[str] = ()
    memories: Sequence[str] = ()
    history: Sequence[Exchange] = ()
    last_said: str | None = None


@dataclass
class Reply:
    text: str
    emotion: Emotion
    source: ReplySource
    memory_lines: list[str] = field(default_factory=list)
    stats: GenerationStats | None = None
    failed_rules: list[str] = field(default_factory=list)
    error: str | None = None
    stopped_early: bool = False


@dataclass
class _Attempt:
    raw: str
    stats: GenerationStats | None
    stopped_early: bool


class Fallbacks:
    """Rotates each character's fallback lines so the same one is never said twice in a row."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def next_line(self, character: Character) -> str:
        lines = character.fallback_lines
        index = self._next.get(character.id, 0) % len(lines)
        self._next[character.id] = index + 1
        return lines[index]


class Responder:
    """Turns a player's line into the line the NPC speaks. It never raises for model trouble."""

    def __init__(self, *, backend: LLMBackend, settings: Settings, roster: Roster) -> None:
        self._backend = backend
        self._settings = settings
        self._roster = roster
        self._fallbacks = Fallbacks()
        self._banned_global = tuple(settings.banned_words)

    def fallback(self, character: Character, *, error: str | None = None, rules: list[str] | None = None) -> Reply:
        return Reply(
            text=self._fallbacks.next_line(character),
            emotion="neutral",
            source="fallback",
            failed_rules=rules or [],
            error=error,
        )

    def _other_speakers(self, character: Character, player_name: str) -> list[str]:
        names = [player_name] if player_name else []
        for other in self._roster.voiced.values():
            if other.id != character.id:
                names.extend({other.name, other.short_name})
        return names

    async def respond(self, context: ReplyContext, *, deadline: float) -> Reply:
        """Generate, clean and check; `deadline` is an event-loop time. Past it: a fallback line."""
        character = context.character
        rules: list[str] = []
        try:
            async with asyncio.timeout_at(deadline):
                history = list(context.history)
                hint: str | None = None
                # The world's lines are left out: repeating what the world just said is not an echo.
                instructions = system_message(
                    character,
                    max_sentences=self._settings.reply_max_sentences,
                    world_lines=(),
                    memory_subject=self._settings.memory_subject,
                )
                for source in ("generated", "regenerated"):
                    attempt = await self._generate(context, history=history, hint=hint, deadline=deadline)
                    spoken, memory_lines = (
                        split_inline_memory(attempt.raw)
                        if character.memory.extract == "inline"
                        else (attempt.raw, [])
                    )
                    cleaned = clean(
                        spoken,
                        own_names=[character.name, character.short_name],
                        other_speakers=self._other_speakers(character, context.player_name),
                        max_sentences=self._settings.reply_max_sentences,
                        max_chars=self._settings.reply_max_chars,
                    )
                    rule = check_reply(
                        cleaned.text,
                        banned=(*self._banned_global, *character.banned),
                        last_line=context.last_said,
                        language=character.speech.language,
                        instructions=instructions,
                    )
                    log.info(
                        "reply_attempt",
                        source=source,
                        rule=rule,
                        raw_chars=len(attempt.raw),
                        stopped_early=attempt.stopped_early,
                        raw=attempt.raw,
                    )
                    if rule is None:
                        return Reply(
                            text=cleaned.text,
                            emotion=cleaned.emotion,
                            source=source,
                            memory_lines=memory_lines,
                            stats=attempt.stats,
                            failed_rules=rules,
                            stopped_early=attempt.stopped_early,
                        )
                    rules.append(rule)
                    hint = regeneration_hint(rule)
                    if rule == "repeat":
                        # The copied line must not stand in the history the model imitates.
                        history = [ex for ex in history if ex.npc != context.last_said]
        except TimeoutError:
            log.warning("reply_deadline_passed", deadline_s=self._settings.reply_deadline_seconds)
            return self.fallback(character, error="deadline", rules=rules)
        except LLMError as exc:
            log.warning("reply_llm_failed", error_type=type(exc).__name__, error=str(exc))
            return self.fallback(character, error=type(exc).__name__, rules=rules)
        return self.fallback(character, rules=rules)

    async def _generate(
        self, context: ReplyContext, *, history: list[Exchange], hint: str | None, deadline: float
    ) -> _Attempt:
        character = context.character
        inline = character.memory.extract == "inline"
        max_tokens = INLINE_REPLY_MAX_TOKENS if inline else REPLY_MAX_TOKENS
        messages = build_reply_messages(
            character,
            max_sentences=self._settings.reply_max_sentences,
            world_lines=context.world_lines,
            memories=context.memories,
            history=history,
            player_line=context.player_line,
            hint=hint,
            context_tokens=self._settings.llm_context_tokens,
            max_reply_tokens=max_tokens,
            memory_subject=self._settings.memory_subject,
        )
        remaining = max(0.1, deadline - asyncio.get_running_loop().time())
        request = GenerationRequest(
            messages=messages,
            model=character.llm.model or self._settings.llm_model,
            temperature=REPLY_TEMPERATURE,
            max_tokens=max_tokens,
            deadline_seconds=remaining,
            stop=(*TEMPLATE_STOP_STRINGS, *TURN_STOP_STRINGS),
            lane=character.llm.lane,
            kind="reply",
        )
        own = [character.name, character.short_name]
        others = self._other_speakers(character, context.player_name)
        raw = ""
        stats: GenerationStats | None = None
        stopped_early = False
        started = time.monotonic()
        async with aclosing(self._backend.stream(request)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, Done):
                    stats = chunk.stats
                    break
                raw += chunk.text
                # Inline memories come after the reply: a strong model must be let finish.
                if not inline and has_enough(
                    raw, own_names=own, other_speakers=others, max_sentences=self._settings.reply_max_sentences
                ):
                    stopped_early = True
                    break
        if stats is None:
            stats = GenerationStats(model=request.model, backend=self._backend.name)
        stats.extra["generation_ms"] = round((time.monotonic() - started) * 1000, 1)
        return _Attempt(raw=raw, stats=stats, stopped_early=stopped_early)
