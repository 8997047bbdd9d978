"""One reply: prompt → LLM stream → cleaner → checks → regenerate or fall back, whole or sentence by sentence.

Whole line (`on_part` None): the stream is read until the line is complete (`has_enough`), cleaned,
and checked whole (replies.md "Checks"); a failure is generated once more with a hint, then a
fallback line.

Sentence by sentence (`on_part` given; replies.md "Sentence by sentence"): every sentence of the
line that is final (`streaming.final_sentences`) is checked on its own and handed to `on_part` at
once, in order (`parts.SaidParts`, which also keeps the repeat rule whole-line). Part 0 failing →
nothing was said: the try is given up (its stream closed) and regenerated, the second try
streaming parts the same way. A later part failing → the line ends with the parts already sent
(`cut_rule`, logged as `reply_part_cut`). After part 0, an LLM error or the deadline ends the line
with the parts sent, under the source of the try that sent them; with no part sent it is a
fallback, never sent in parts. The reply's text is then exactly the parts joined, its emotion that
of part 0.

One `Deadline` bounds the whole reply: one timeout scope here, and what is left of it is each LLM
request's `deadline_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import structlog

from bridge.errors import LLMError
from bridge.llm.base import TEMPLATE_STOP_STRINGS, Done, GenerationRequest, GenerationStats, LLMBackend
from bridge.memory.recall import Recalled
from bridge.npc.characters import Character, Roster
from bridge.npc.checks import RULE_EMPTY, RULE_REPEAT, check_reply, regeneration_hint
from bridge.npc.cleaner import OtherSpeakers
from bridge.npc.deadline import Deadline
from bridge.npc.fallbacks import Fallbacks
from bridge.npc.parts import PartSink, Rules, SaidParts
from bridge.npc.prompt import Exchange, build_reply_messages, system_message
from bridge.npc.streaming import Cleaning, split_inline_memory
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
    memories: Sequence[Recalled] = ()
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
    parts: list[str] = field(default_factory=list)  # the parts sent; joined they are `text`
    cut_rule: str | None = None  # the rule a later part failed: the line ended before it
    requested_at: float | None = None  # time.monotonic() of the reply's first LLM request
    first_part_at: float | None = None  # time.monotonic() when part 0 was handed over

    @property
    def first_part_ms(self) -> float | None:
        """From the reply's first LLM request to part 0 handed to the world."""
        if self.requested_at is None or self.first_part_at is None:
            return None
        return round((self.first_part_at - self.requested_at) * 1000, 1)


@dataclass
class _Attempt:
    raw: str
    stats: GenerationStats | None
    stopped_early: bool
    rule: str | None = None  # a part failed this rule while streaming (part 0: regenerate)


class CastSpeakers:
    """Whose speaker labels cut each character's reply (replies.md "Cleaning" step 2): the other voiced
    characters' names, known per character at start and at every `Roster.replace`; the player's name
    is added per reply. Nothing here walks the cast on the reply path."""

    def __init__(self, roster: Roster) -> None:
        self._cast = roster.derive(_Cast.of)

    def of(self, character: Character, player_name: str = "") -> OtherSpeakers:
        cast = self._cast.value
        known = cast.by_id.get(character.id)
        if known is not None and known[0] is character:
            speakers = known[1]
        else:
            # Not voiced, or from before a replace: the current cast's names, its own left out.
            speakers = cast.names.with_own(_own_names(character))
        return speakers.with_player(player_name) if player_name else speakers


def _own_names(character: Character) -> tuple[str, str]:
    return character.name, character.short_name


@dataclass(frozen=True)
class _Cast:
    names: OtherSpeakers  # every voiced name: one set, shared by all characters (memory O(N), not O(N²))
    by_id: dict[str, tuple[Character, OtherSpeakers]]

    @classmethod
    def of(cls, voiced: Mapping[str, Character]) -> _Cast:
        names = OtherSpeakers.of(name for c in voiced.values() for name in _own_names(c))
        return cls(names, {cid: (c, names.with_own(_own_names(c))) for cid, c in voiced.items()})


class Responder:
    """Turns a player's line into the line the NPC speaks. It never raises for model trouble."""

    def __init__(self, *, backend: LLMBackend, settings: Settings, roster: Roster) -> None:
        self._backend = backend
        self._settings = settings
        self._speakers = CastSpeakers(roster)
        self._fallbacks = Fallbacks()
        self._banned_global = tuple(settings.banned_words)

    def use_banned_words(self, words: Sequence[str]) -> None:
        """The global banned words from now on (a reload re-reads them; each character's are its own)."""
        self._banned_global = tuple(words)

    def fallback(self, character: Character, *, error: str | None = None, rules: list[str] | None = None) -> Reply:
        return Reply(
            text=self._fallbacks.next_line(character),
            emotion="neutral",
            source="fallback",
            failed_rules=rules or [],
            error=error,
        )

    def _other_speakers(self, character: Character, player_name: str) -> OtherSpeakers:
        return self._speakers.of(character, player_name)

    async def respond(self, context: ReplyContext, *, deadline: Deadline, on_part: PartSink | None = None) -> Reply:
        """Generate, clean and check (sentence by sentence with `on_part`).

        Past `deadline`, or on an LLM error: the parts already sent, else a fallback line.
        """
        character = context.character
        said = SaidParts(sink=on_part)
        failed: list[str] = []
        # The world's lines are left out: repeating what the world just said is not an echo.
        instructions = system_message(
            character,
            max_sentences=self._settings.reply_max_sentences,
            world_lines=(),
            memory_subject=self._settings.memory_subject,
        )
        rules = Rules(
            banned=(*self._banned_global, *character.banned),
            last_said=context.last_said,
            language=character.speech.language,
            instructions=instructions,
        )
        history = list(context.history)
        hint: str | None = None
        try:
            async with deadline.scope():
                for source in ("generated", "regenerated"):
                    said.source = source
                    reply, rule = await self._try(context, said, rules, history=history, hint=hint, deadline=deadline)
                    if reply is not None:
                        reply.failed_rules = failed
                        return reply
                    failed.append(rule)
                    hint = regeneration_hint(rule, language=character.speech.language)
                    if rule == RULE_REPEAT:
                        # The copied line must not stand in the history the model imitates.
                        history = [ex for ex in history if ex.npc != context.last_said]
        except TimeoutError:
            seconds = self._settings.reply_deadline_seconds
            log.warning("reply_deadline_passed", deadline_s=seconds, reason=deadline.reason, parts=len(said.parts))
            return self._cut_short(character, said, failed, error=deadline.reason)
        except LLMError as exc:
            log.warning("reply_llm_failed", error_type=type(exc).__name__, error=str(exc), parts=len(said.parts))
            return self._cut_short(character, said, failed, error=type(exc).__name__)
        return self.fallback(character, rules=failed)

    def _cut_short(self, character: Character, said: SaidParts, failed: list[str], *, error: str) -> Reply:
        """The reply after an error or the deadline: the parts already sent, else a fallback."""
        if not said.parts:
            return self.fallback(character, error=error, rules=failed)
        return self._said_reply(said, failed_rules=failed, error=error)

    def _said_reply(
        self,
        said: SaidParts,
        *,
        failed_rules: list[str] | None = None,
        error: str | None = None,
        attempt: _Attempt | None = None,
        memory_lines: list[str] | None = None,
        cut_rule: str | None = None,
    ) -> Reply:
        """The line made of the parts sent: their text joined, part 0's emotion, the try's source."""
        return Reply(
            text="".join(said.parts),
            emotion=said.emotion,
            source=said.source,
            memory_lines=memory_lines or [],
            stats=attempt.stats if attempt else None,
            failed_rules=failed_rules or [],
            error=error,
            stopped_early=attempt.stopped_early if attempt else False,
            parts=list(said.parts),
            cut_rule=cut_rule,
            requested_at=said.requested_at,
            first_part_at=said.first_part_at,
        )

    async def _try(
        self,
        context: ReplyContext,
        said: SaidParts,
        rules: Rules,
        *,
        history: list[Exchange],
        hint: str | None,
        deadline: Deadline,
    ) -> tuple[Reply | None, str]:
        """One try: the reply, or None and the rule the line (or its part 0) failed."""
        character = context.character
        attempt = await self._generate(context, said, rules, history=history, hint=hint, deadline=deadline)
        inline = character.memory.extract == "inline"
        spoken, memory_lines = split_inline_memory(attempt.raw) if inline else (attempt.raw, [])
        if said.sink is None:
            cleaned = self._cleaning(context).clean(spoken)
            rule = check_reply(
                cleaned.text,
                banned=rules.banned,
                last_line=rules.last_said,
                language=character.speech.language,
                instructions=rules.instructions,
            )
            text, emotion = cleaned.text, cleaned.emotion
        else:
            rule = attempt.rule
            if rule is None:
                progress = self._cleaning(context).final(spoken, ended=True)
                rule = await said.release(progress, rules)
            if rule is None and not said.parts:
                rule = RULE_EMPTY
            text, emotion = "".join(said.parts), said.emotion
        log.info(
            "reply_attempt",
            source=said.source,
            rule=rule,
            raw_chars=len(attempt.raw),
            stopped_early=attempt.stopped_early,
            parts=len(said.parts) if said.sink is not None else None,
            raw=attempt.raw,
        )
        if said.parts:
            # Something was said: the line ends with it, whatever a later part broke.
            if rule is not None:
                log.warning("reply_part_cut", rule=rule, index=len(said.parts), parts=len(said.parts))
            kept = memory_lines if rule is None else []
            return self._said_reply(said, attempt=attempt, memory_lines=kept, cut_rule=rule), ""
        if rule is not None:
            return None, rule
        return Reply(
            text=text,
            emotion=emotion,
            source=said.source,
            memory_lines=memory_lines,
            stats=attempt.stats,
            stopped_early=attempt.stopped_early,
            requested_at=said.requested_at,
        ), ""

    def _cleaning(self, context: ReplyContext) -> Cleaning:
        character = context.character
        return Cleaning(
            own_names=(character.name, character.short_name),
            other_speakers=self._other_speakers(character, context.player_name),
            max_sentences=self._settings.reply_max_sentences,
            max_chars=self._settings.reply_max_chars,
        )

    async def _generate(
        self,
        context: ReplyContext,
        said: SaidParts,
        rules: Rules,
        *,
        history: list[Exchange],
        hint: str | None,
        deadline: Deadline,
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
        request = GenerationRequest(
            messages=messages,
            model=character.llm.model or self._settings.llm_model,
            temperature=REPLY_TEMPERATURE,
            max_tokens=max_tokens,
            deadline_seconds=max(0.1, deadline.remaining()),
            stop=(*TEMPLATE_STOP_STRINGS, *TURN_STOP_STRINGS),
            lane=character.llm.lane,
            kind="reply",
        )
        cleaning = self._cleaning(context)
        raw = ""
        stats: GenerationStats | None = None
        stopped_early = False
        rule: str | None = None
        said.final_seen = 0
        started = time.monotonic()
        if said.requested_at is None:
            said.requested_at = started
        async with aclosing(self._backend.stream(request)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, Done):
                    stats = chunk.stats
                    break
                raw += chunk.text
                if said.sink is not None:
                    read_at = time.time()
                    spoken = split_inline_memory(raw)[0] if inline else raw
                    if not cleaning.may_advance(spoken, said.final_seen):
                        continue
                    progress = cleaning.final(spoken)
                    rule = await said.release(progress, rules, read_at=read_at)
                    # Inline memories come after the reply: a strong model must be let finish.
                    if rule is not None or (progress.complete and not inline):
                        stopped_early = True
                        break
                elif not inline and cleaning.enough(raw):
                    stopped_early = True
                    break
        if stats is None:
            stats = GenerationStats(model=request.model, backend=self._backend.name)
        stats.extra["generation_ms"] = round((time.monotonic() - started) * 1000, 1)
        return _Attempt(raw=raw, stats=stats, stopped_early=stopped_early, rule=rule)
