"""The checks every memory candidate must pass before it is kept (memory.md "The checks"); pure code.

Each rule is a small function returning the rule's name when the candidate breaks it, else None. The
rules run in the order listed in `RULE_ORDER`; the first one broken is the reason logged.
Lengths and comparisons use the trimmed, NFKC-normalised text; what is stored is the trimmed text.
Comparisons (duplicates, prompt copies) also drop spaces and punctuation and ignore letter case.
A candidate equal to or containing a stored memory is "said again" (`decide`, `apply_kept`): it
refreshes or replaces that memory instead of being rejected.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from bridge.compare import comparable, copies_run
from bridge.memory.models import Memory
from bridge.settings import Settings

MIN_CHARS = 6
MAX_CHARS = 80
MAX_KEPT = 3
PROMPT_COPY_RUN_CHARS = 8

# Markup a memory must not hold (checked after NFKC, so full-width forms count too).
MARKUP_CHARS = frozenset("<>{}[]*#`")
URL_PATTERN = re.compile(r"(?:https?|ftp)://|www\.", re.IGNORECASE)
# Sentence ends: a '.' between digits (3.5) is a decimal point, not an end.
SENTENCE_END_PATTERN = re.compile(r"[。!?｡]|\.(?!\d)")
# What may close the one sentence: end marks, ellipses and closing quotes/brackets.
TRAILING_CLOSERS = "。.!?｡…‥」』）)\"'”’ "
LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


@dataclass(frozen=True)
class MemoryRules:
    """What the checks need; `instructions` is the extraction prompt's own instruction text."""

    subject: str = "ユーザー"
    mood_words: tuple[str, ...] = ()
    non_fact_words: tuple[str, ...] = ()
    order_words: tuple[str, ...] = ()
    instructions: str = ""
    min_chars: int = MIN_CHARS
    max_chars: int = MAX_CHARS
    max_kept: int = MAX_KEPT

    @classmethod
    def from_settings(cls, settings: Settings, *, instructions: str) -> MemoryRules:
        return cls(
            subject=settings.memory_subject,
            mood_words=settings.memory_mood_words,
            non_fact_words=settings.memory_non_fact_words,
            order_words=settings.memory_order_words,
            instructions=instructions,
        )


@dataclass(frozen=True)
class Rejection:
    text: object  # what the model wrote: not always a string
    rule: str


def nfkc(text: str) -> str:
    """Trimmed and NFKC-normalised: the form lengths and word rules use."""
    return unicodedata.normalize("NFKC", text.strip())


# --- the rules: (normalised text, rules) -> broken? ---------------------------------------------


def breaks_subject(text: str, rules: MemoryRules) -> bool:
    return not text.startswith(unicodedata.normalize("NFKC", rules.subject))


def breaks_length(text: str, rules: MemoryRules) -> bool:
    return not rules.min_chars <= len(text) <= rules.max_chars


def breaks_line_break(text: str, rules: MemoryRules) -> bool:
    return any(ch in LINE_BREAKS for ch in text)


def breaks_markup(text: str, rules: MemoryRules) -> bool:
    return any(ch in MARKUP_CHARS for ch in text) or URL_PATTERN.search(text) is not None


def breaks_one_sentence(text: str, rules: MemoryRules) -> bool:
    body = text.rstrip(TRAILING_CLOSERS)
    return SENTENCE_END_PATTERN.search(body) is not None


def _contains_any(text: str, words: Sequence[str]) -> bool:
    folded = text.casefold()
    return any(word and unicodedata.normalize("NFKC", word).casefold() in folded for word in words)


def breaks_mood(text: str, rules: MemoryRules) -> bool:
    return _contains_any(text, rules.mood_words)


def breaks_non_fact(text: str, rules: MemoryRules) -> bool:
    return _contains_any(text, rules.non_fact_words)


def breaks_order(text: str, rules: MemoryRules) -> bool:
    return _contains_any(text, rules.order_words)


def breaks_prompt_copy(text: str, rules: MemoryRules) -> bool:
    return copies_run(text, rules.instructions, run_chars=PROMPT_COPY_RUN_CHARS)


def is_duplicate(text: str, kept: Sequence[str]) -> bool:
    """Same as, contained in, or containing a kept memory once width, spaces and punctuation go."""
    probe = comparable(text)
    for other in kept:
        known = comparable(other)
        if known and (probe in known or known in probe):
            return True
    return False


def is_contained(text: str, stored: Sequence[str]) -> bool:
    """A part of a stored memory and equal to none: it says less than what is known."""
    probe = comparable(text)
    forms = [comparable(known) for known in stored]
    return probe not in forms and any(probe in known for known in forms)


Rule = Callable[[str, MemoryRules], bool]

# memory.md order: the form of the text first, then its meaning, then what is already known.
RULE_ORDER: tuple[tuple[str, Rule], ...] = (
    ("subject", breaks_subject),
    ("length", breaks_length),
    ("line_break", breaks_line_break),
    ("markup", breaks_markup),
    ("one_sentence", breaks_one_sentence),
    ("mood", breaks_mood),
    ("non_fact", breaks_non_fact),
    ("order", breaks_order),
)


def broken_rule(
    candidate: object, *, kept: Sequence[str], rules: MemoryRules, stored: Sequence[str] = ()
) -> str | None:
    """The first rule `candidate` breaks, or None when it may be kept.

    `kept`: memories it must not equal, contain or be contained in (all, when said-again is off);
    `stored`: memories it must only not be a part of (memory.md "Said again").
    """
    if not isinstance(candidate, str):
        return "not_a_string"
    text = nfkc(candidate)
    for name, breaks in RULE_ORDER:
        if breaks(text, rules):
            return name
    if is_duplicate(text, kept) or is_contained(text, stored):
        return "duplicate"
    if breaks_prompt_copy(text, rules):
        return "prompt_copy"
    return None


@dataclass(frozen=True)
class Kept:
    """A candidate that passed, and what it does to the stored memories (memory.md "Said again").

    `refreshes`: the stored memory it equals; that memory gets the new date and the newest place, and
    nothing is added. `replaces`: the stored memories that are a part of it; they are removed and the
    candidate is added. Neither: a new memory.
    """

    text: str  # trimmed
    refreshes: str | None = None
    replaces: tuple[str, ...] = ()


def _said_again(text: str, stored: Sequence[str]) -> Kept:
    probe = comparable(text)
    for known in stored:
        if comparable(known) == probe:
            return Kept(text, refreshes=known)
    return Kept(text, replaces=tuple(known for known in stored if comparable(known) in probe))


def decide(
    candidates: list[object], *, stored: Sequence[str], rules: MemoryRules, said_again: bool = True
) -> tuple[list[Kept], list[Rejection]]:
    """Candidates in the model's order → (those kept, with what each does to `stored`; rejections).

    `stored` holds the memories already stored. With `said_again`, a candidate equal to or containing a
    stored memory is kept as a refresh or a replacement; without (a shared-memory character, whose
    memories live in the service), it is a duplicate like one contained in a stored memory. Each
    candidate kept joins the comparison for the next as a duplicate in every direction. At most
    `rules.max_kept` are kept (refreshes count); later ones are rejected as `over_limit` unchecked.
    """
    accepted: list[Kept] = []
    rejected: list[Rejection] = []
    known = [] if said_again else list(stored)
    for candidate in candidates:
        if len(accepted) >= rules.max_kept:
            rejected.append(Rejection(candidate, "over_limit"))
            continue
        rule = broken_rule(candidate, kept=known, rules=rules, stored=stored if said_again else ())
        if rule is not None:
            rejected.append(Rejection(candidate, rule))
            continue
        assert isinstance(candidate, str)  # broken_rule refused every non-string
        text = candidate.strip()
        accepted.append(_said_again(text, stored) if said_again else Kept(text))
        known.append(text)
    return accepted, rejected


def check_candidates(
    candidates: list[object], *, kept: Sequence[str], rules: MemoryRules
) -> tuple[list[str], list[Rejection]]:
    """`decide` without said-again: the texts to store and the rejections (`kept`: stored memories)."""
    accepted, rejected = decide(candidates, stored=kept, rules=rules, said_again=False)
    return [item.text for item in accepted], rejected


def apply_kept(
    memories: Sequence[Memory], kept: Sequence[Kept], *, heard_at: datetime, source: str
) -> tuple[Memory, ...]:
    """The memory list after `kept` (in the model's order): refreshed ones and new ones at the end,
    dated `heard_at`; replaced ones removed. A refreshed memory keeps its text and source."""
    result = list(memories)
    for item in kept:
        gone = {item.refreshes} if item.refreshes is not None else set(item.replaces)
        moved = [memory for memory in result if memory.text in gone]
        result = [memory for memory in result if memory.text not in gone]
        if item.refreshes is not None:
            # The stored text may have gone meanwhile (forgotten): then it is added as told.
            # (A new item, not model_copy: that would carry the old item's cached JSON line.)
            result.extend(
                [Memory(text=memory.text, heard_at=heard_at, source=memory.source) for memory in moved[-1:]]
                or [Memory(text=item.text, heard_at=heard_at, source=source)]
            )
        else:
            result.append(Memory(text=item.text, heard_at=heard_at, source=source))
    return tuple(result)
