"""The checks every memory candidate must pass before it is kept (memory.md "The checks"); pure code.

Each rule is a small function returning the rule's name when the candidate breaks it, else None. The
rules run in the order listed in `RULE_ORDER`; the first one broken is the reason logged.
Lengths and comparisons use the trimmed, NFKC-normalised text; what is stored is the trimmed text.
Comparisons (duplicates, prompt copies) also drop spaces and punctuation and ignore letter case.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bridge.compare import comparable, copies_run
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


def broken_rule(candidate: object, *, kept: Sequence[str], rules: MemoryRules) -> str | None:
    """The first rule `candidate` breaks, or None when it may be kept."""
    if not isinstance(candidate, str):
        return "not_a_string"
    text = nfkc(candidate)
    for name, breaks in RULE_ORDER:
        if breaks(text, rules):
            return name
    if is_duplicate(text, kept):
        return "duplicate"
    if breaks_prompt_copy(text, rules):
        return "prompt_copy"
    return None


def check_candidates(
    candidates: list[object], *, kept: Sequence[str], rules: MemoryRules
) -> tuple[list[str], list[Rejection]]:
    """Candidates in the model's order → (texts to store, trimmed; rejections with their rule).

    `kept` holds the memories already stored; each candidate kept here joins it for the next one.
    At most `rules.max_kept` are kept; later ones are rejected as `over_limit` without other checks.
    """
    accepted: list[str] = []
    rejected: list[Rejection] = []
    known = list(kept)
    for candidate in candidates:
        if len(accepted) >= rules.max_kept:
            rejected.append(Rejection(candidate, "over_limit"))
            continue
        rule = broken_rule(candidate, kept=known, rules=rules)
        if rule is not None:
            rejected.append(Rejection(candidate, rule))
            continue
        assert isinstance(candidate, str)  # broken_rule refused every non-string
        text = candidate.strip()
        accepted.append(text)
        known.append(text)
    return accepted, rejected
