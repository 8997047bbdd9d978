"""Which memories go into a reply prompt (memory.md "Recall"): the newest few, then what the line is about.

Pure code: memories and the query in, the chosen memories out, each with the reason it was chosen.

How the places are filled (at most `limit`):
1. the newest `recent` memories, always (newest = last in the file: a memory said again moves there);
2. then, among the rest, those relevant to the query (the player's line, and their previous line when
   the caller has one), highest score first, ties to the newer;
3. places still free go to the next newest. A memory that scores 0 is never picked as relevant.
The chosen memories come back oldest first (by `heard_at`, then file order), as the prompt shows them.

Relevance is BM25 over *terms* of normalised texts (NFKC, lower case; spaces, punctuation and the
subject word cut the text into runs, and are dropped):
- Japanese (the default): every two adjacent characters of a run is a term (a one-character run is a
  term of its own). No tokenizer: "盆栽の枝" and "盆栽を育てている" share the term 盆栽.
- English characters (`language: "en"`): the words of a run, a trailing "s" dropped from words longer
  than three letters, so "cats" meets "cat".
The subject word (`ユーザー`, "User") is cut out before terms are made, so it never counts. The score of
a memory, summed over the query's distinct terms t that the memory holds:

    idf(t) · tf·(K1 + 1) / (tf + K1·(1 − B + B·length/average length))
    idf(t) = max(0, ln((N − n + 0.5) / (n + 0.5)))      N memories, n of them hold t

so a term rare among this NPC's memories (盆栽, カヌー) counts much, and one found in half of them or
more (が好, き, particles next to the subject) counts nothing. `Recalled.matched` keeps the terms that
scored, which is how `npc-bridge chat --explain` shows why a memory was picked.

Cost: the terms and document frequencies of an NPC's memories are built once per distinct memory list
(cached); a recall then looks up only the query's terms.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, tzinfo
from functools import lru_cache
from typing import Literal

from bridge.memory.models import Memory

Why = Literal["recent", "relevant"]
Language = Literal["ja", "en"]

K1 = 1.2  # how fast a repeated term stops adding (BM25's usual value)
B = 0.75  # how much a long memory is discounted (BM25's usual value)
# Memory lists kept indexed (one per NPC that talked lately; ~60 KiB each for 60 memories) and texts
# kept split into terms: bounded so that a cast of hundreds costs a few MiB, not one index each.
INDEX_CACHE_SIZE = 32
TERMS_CACHE_SIZE = INDEX_CACHE_SIZE * 64
SEPARATOR = " "  # what the subject word is replaced by: a space ends a run like punctuation does
# Anything but letters and digits (of any script; the long-vowel mark ー is a letter) ends a run.
NOT_LETTERS = re.compile(r"[\W_]+")


@dataclass(frozen=True)
class Recalled:
    """One memory chosen for a prompt, and why: one of the newest, or relevant with its score."""

    text: str
    heard_at: datetime | None  # None: the date is unknown (a shared service's item without one)
    why: Why
    score: float = 0.0  # the BM25 score against the query (0 for a recent one)
    matched: tuple[str, ...] = ()  # the query's terms this memory holds, highest weight first


def recall_fields(recalled: Sequence[Recalled]) -> dict[str, object]:
    """What a reply's log line says of its memories: how many were recalled for each reason, and
    their texts (a content key: the log filter keeps them only with content logging on)."""
    relevant = sum(1 for item in recalled if item.why == "relevant")
    return {
        "recalled_recent": len(recalled) - relevant,
        "recalled_relevant": relevant,
        "recalled": [item.text for item in recalled],
    }


# ---- terms ------------------------------------------------------------------------------------------


def _runs(text: str, subject: str) -> list[str]:
    """The normalised text cut at spaces, punctuation, symbols and the subject word."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    if subject:
        folded = folded.replace(subject, SEPARATOR)
    return [run for run in NOT_LETTERS.split(folded) if run]


def _word(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def terms(text: str, subject: str, language: Language = "ja") -> tuple[str, ...]:
    """The terms of `text` (module docstring), in order, repeats kept."""
    subject = unicodedata.normalize("NFKC", subject).casefold().strip()
    found: list[str] = []
    for run in _runs(text, subject):
        if language == "en":
            found.append(_word(run))  # a space ends a run: each run is one word
        elif len(run) == 1:
            found.append(run)
        else:
            found.extend(run[i : i + 2] for i in range(len(run) - 1))
    return tuple(found)


# ---- the index of one NPC's memories ------------------------------------------------------------------


@dataclass(frozen=True)
class _Index:
    postings: dict[str, list[tuple[int, int]]]  # term → (memory number, count in it), for each holder
    norms: list[float]  # K1·(1 − B + B·length/average length), per memory
    total: int  # N

    def idf(self, term: str) -> float:
        held = len(self.postings.get(term, ()))
        return max(0.0, math.log((self.total - held + 0.5) / (held + 0.5))) if held else 0.0


@lru_cache(maxsize=TERMS_CACHE_SIZE)
def _term_counts(text: str, subject: str, language: Language) -> tuple[int, tuple[tuple[str, int], ...]]:
    """A memory's length in terms and its distinct terms with their counts (cached: memories repeat,
    player lines do not)."""
    found = terms(text, subject, language)
    return len(found), tuple(Counter(found).items())


@lru_cache(maxsize=INDEX_CACHE_SIZE)
def _index(texts: tuple[str, ...], subject: str, language: Language) -> _Index:
    postings: dict[str, list[tuple[int, int]]] = {}
    lengths: list[int] = []
    for number, text in enumerate(texts):
        length, found = _term_counts(text, subject, language)
        lengths.append(length)
        for term, count in found:
            postings.setdefault(term, []).append((number, count))
    average = (sum(lengths) / len(lengths)) if lengths else 0.0
    norms = [K1 * (1 - B + B * (length / average if average else 0.0)) for length in lengths]
    return _Index(postings, norms, len(texts))


def scores(
    texts: Sequence[str], query: Sequence[str], *, subject: str, language: Language = "ja"
) -> dict[int, tuple[float, tuple[str, ...]]]:
    """BM25 score against the query texts, with the terms that scored (highest first), of each memory
    (by its number in `texts`) that scores above 0; those left out score 0."""
    index = _index(tuple(texts), subject, language)
    wanted = {term for line in query if line for term in terms(line, subject, language)}
    found: dict[int, list[tuple[float, str]]] = {}
    for term in wanted:
        weight = index.idf(term)
        if weight <= 0.0:
            continue
        for number, count in index.postings[term]:
            part = weight * count * (K1 + 1) / (count + index.norms[number])
            found.setdefault(number, []).append((part, term))
    return {
        number: (sum(part for part, _ in parts), tuple(term for _, term in sorted(parts, reverse=True)))
        for number, parts in found.items()
    }


# ---- choosing ------------------------------------------------------------------------------------------


def recall(
    memories: Sequence[Memory],
    query: Sequence[str],
    *,
    limit: int,
    recent: int,
    subject: str,
    language: Language = "ja",
    zone: tzinfo | None = None,
) -> list[Recalled]:
    """The memories for one prompt, oldest first (module docstring), dated in `zone` when given.

    `memories` in file order (oldest first); `query`: the player's line and, when there is one, their
    previous line (empty texts are skipped). `recent` is clamped to `limit`
    (NPC_BRIDGE_MEMORY_RECALL_RECENT larger than NPC_BRIDGE_MEMORY_RECALL means "all of them recent").
    """
    limit = max(0, limit)
    recent = min(max(0, recent), limit)
    total = len(memories)
    newest_first = range(total - 1, -1, -1)
    chosen: dict[int, Recalled] = {}
    for number in newest_first[:recent]:
        chosen[number] = _item(memories[number], "recent")
    if len(chosen) < min(limit, total):
        scored = scores([item.text for item in memories], query, subject=subject, language=language)
        # Highest score first; among equal scores the newer (higher number) first.
        relevant = sorted(
            (number for number in scored if number not in chosen),
            key=lambda number: (scored[number][0], number),
            reverse=True,
        )
        for number in relevant[: limit - len(chosen)]:
            score, matched = scored[number]
            chosen[number] = _item(memories[number], "relevant", score, matched)
        for number in newest_first:
            if len(chosen) >= limit:
                break
            if number not in chosen:
                chosen[number] = _item(memories[number], "recent")
    order = sorted(chosen, key=lambda number: (memories[number].heard_at, number))
    return [in_zone(chosen[number], zone) for number in order]


def in_zone(item: Recalled, zone: tzinfo | None) -> Recalled:
    """`item` with its date as seen in `zone` (None: as it is): the prompt shows that date's M/D."""
    if zone is None or item.heard_at is None:
        return item
    return replace(item, heard_at=item.heard_at.astimezone(zone))


def _item(memory: Memory, why: Why, score: float = 0.0, matched: tuple[str, ...] = ()) -> Recalled:
    return Recalled(text=memory.text, heard_at=memory.heard_at, why=why, score=score, matched=matched)
