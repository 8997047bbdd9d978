"""How text is compared for copies and duplicates: one form, one "copies a run" check for replies
(npc/checks: a reply reciting its instructions) and memories (memory/checks: a memory copying the
extraction prompt)."""

from __future__ import annotations

import functools
import unicodedata


def comparable(text: str) -> str:
    """NFKC, no spaces, no punctuation, case folded: the form duplicates and copies are compared in."""
    return "".join(
        ch
        for ch in unicodedata.normalize("NFKC", text).casefold()
        if not ch.isspace() and not unicodedata.category(ch).startswith("P")
    )


@functools.lru_cache(maxsize=64)
def _comparable_source(source: str) -> str:
    # The same instructions come back for every reply of an NPC and every extraction: normalise once.
    return comparable(source)


def copies_run(text: str, source: str, *, run_chars: int) -> bool:
    """Whether `text` holds `run_chars` or more consecutive characters of `source` (compared forms)."""
    probe, haystack = comparable(text), _comparable_source(source)
    if len(probe) < run_chars or not haystack:
        return False
    return any(probe[i : i + run_chars] in haystack for i in range(len(probe) - run_chars + 1))
