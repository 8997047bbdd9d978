"""How text is compared for copies and duplicates: one form, one "copies a run" check for replies
(npc/checks: a reply reciting its instructions) and memories (memory/checks: a memory copying the
extraction prompt)."""

from __future__ import annotations

import functools
import unicodedata


class _DropSpacesAndPunctuation(dict[int, str | None]):
    """A `str.translate` table filled on first sight of each character: the loop over the text runs
    in C, and only a character not seen before costs a Python call."""

    def __missing__(self, code: int) -> str | None:
        char = chr(code)
        kept = None if char.isspace() or unicodedata.category(char).startswith("P") else char
        self[code] = kept
        return kept


_DROP = _DropSpacesAndPunctuation()


def comparable(text: str) -> str:
    """NFKC, no spaces, no punctuation, case folded: the form duplicates and copies are compared in."""
    return unicodedata.normalize("NFKC", text).casefold().translate(_DROP)


# Keyed by instructions: one per NPC (its system message) plus the extraction prompt. Sized for a cast of
# a thousand: a smaller cache misses on every reply once more NPCs than it holds take turns.
@functools.lru_cache(maxsize=1024)
def _comparable_source(source: str) -> str:
    return comparable(source)


def copies_run(text: str, source: str, *, run_chars: int) -> bool:
    """Whether `text` holds `run_chars` or more consecutive characters of `source` (compared forms)."""
    probe, haystack = comparable(text), _comparable_source(source)
    if len(probe) < run_chars or not haystack:
        return False
    return any(probe[i : i + run_chars] in haystack for i in range(len(probe) - run_chars + 1))
