"""Sentence by sentence for one reply (replies.md "Sentence by sentence"): each final sentence checked, handed over.

`SaidParts.release` takes what the stream holds (`streaming.Progress`) and hands every final sentence
not yet sent to the reply's part sink, in order, each after the per-sentence checks (`check_sentence`:
empty, banned word, language, echo). It returns the rule a sentence failed; the responder decides
what that means (part 0: regenerate; a later part: the line ends with the parts sent). The repeat
rule is for the whole line: while the line so far is still the start of the last line said to this
player, nothing is said (a part 0 equal to that whole line waits until the line is complete).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from bridge.npc.checks import RULE_REPEAT, Language, check_sentence, may_repeat, repeats
from bridge.npc.streaming import Progress
from bridge.speech import Emotion, ReplySource

log = structlog.get_logger(__name__)

# A part whose sentence no longer starts the finished line (never expected: logged as a bug).
RULE_DIVERGED = "diverged"

# Receives each part as it is final and checked: (index, text, emotion of the line).
PartSink = Callable[[int, str, Emotion], Awaitable[None]]


@dataclass(frozen=True)
class Rules:
    """What each sentence and the line are checked against."""

    banned: tuple[str, ...]
    last_said: str | None
    language: Language
    instructions: str


@dataclass
class SaidParts:
    """What one reply has said in parts so far (across its tries; read again after an error)."""

    sink: PartSink | None
    parts: list[str] = field(default_factory=list)
    emotion: Emotion = "neutral"
    source: ReplySource = "generated"
    requested_at: float | None = None
    first_part_at: float | None = None
    final_seen: int = 0  # final sentences found in the current try (some may be held back)

    async def release(self, progress: Progress, rules: Rules, *, read_at: float | None = None) -> str | None:
        """Check and hand over the final sentences not yet sent; the rule one failed, if any.

        `read_at` (epoch seconds): when the chunk that made them final was read from the LLM; a debug
        line per part then says how long the bridge held it (the benchmark splits part 0's delay with it).
        """
        self.final_seen = len(progress.final)
        # What is final may look less final for a moment ("はい。\nみのり："), never different.
        overlap = min(len(self.parts), len(progress.final))
        shorter = progress.complete and len(progress.final) < len(self.parts)
        if progress.final[:overlap] != tuple(self.parts[:overlap]) or shorter:
            log.error("reply_parts_diverged", parts=len(self.parts), final=len(progress.final))
            return RULE_DIVERGED
        if not self.parts and progress.final:
            # The repeat rule is for the whole line: while the line may still turn out to be the
            # last one again, nothing of it is said.
            line = "".join(progress.final)
            if progress.complete and repeats(line, rules.last_said):
                return RULE_REPEAT
            if not progress.complete and may_repeat(line, rules.last_said):
                return None
        for index in range(len(self.parts), len(progress.final)):
            text = progress.final[index]
            rule = check_sentence(text, banned=rules.banned, language=rules.language, instructions=rules.instructions)
            if rule is not None:
                return rule
            if index == 0:
                self.emotion = progress.emotion
            assert self.sink is not None
            if read_at is not None:
                held_ms = round((time.time() - read_at) * 1000, 3)
                log.debug("reply_part_handed", index=index, read_at=round(read_at, 6), held_ms=held_ms)
            await self.sink(index, text, self.emotion)
            self.parts.append(text)
            if index == 0:
                self.first_part_at = time.monotonic()
        return None
