"""What of a reply still being streamed is settled: when to stop reading, which sentences are final.

The cleaning itself is `bridge.npc.cleaner` (steps 1-5) and `bridge.npc.sentences` (step 6); this
module answers two questions about a raw text that is still arriving:

- `has_enough`: can reading stop, because what is still to come would be cut anyway?
- `final_sentences`: which sentences of the line are *final* (replies.md "Sentence by sentence"):
  nothing later in the stream can change them, and each is exactly the text it has in the line
  cleaned whole, so a world that shows them (`npc:say:part`) never has to take one back.

and splits inline memory (`<memory>` blocks) from the spoken part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bridge.npc.cleaner import Cleaned, OtherSpeakers, clean, clean_body, fold_names, may_become_label, other_names
from bridge.npc.sentences import CLOSERS, END_MARKS, QUOTE_PAIRS, finish, fit_units, open_quote, units
from bridge.speech import Emotion


def has_enough(
    raw_so_far: str,
    *,
    own_names: Sequence[str],
    other_speakers: Sequence[str] | OtherSpeakers,
    max_sentences: int,
    max_chars: int = 0,
) -> bool:
    """Whether reading the stream can stop now: the line is complete, what is still to come is cut.

    True as soon as the raw text holds a cut point (a complete template marker, step 1, or another
    speaker's label with its colon at a line or sentence start, step 2), or `max_sentences`
    sentences are final (`final_sentences`), or (with `max_chars`) the next one can no longer fit.
    Then call `clean` on the text received so far. (An emotion tag the model would only have
    written after those sentences is missed: models put it first.)

    For a character with inline memory (`memory.extract: "inline"`), stopping early would lose the
    `<memory>` block written after the reply: read such a stream to its end.
    """
    if not may_advance(raw_so_far, 0, max_sentences=max_sentences, max_chars=max_chars, final=max_sentences):
        return False
    return final_sentences(
        raw_so_far,
        own_names=own_names,
        other_speakers=other_speakers,
        max_sentences=max_sentences,
        max_chars=max_chars,
    ).complete


# What every cut point holds: a template marker `<` or `[INST]`, a heading `#`, a label's colon.
_CUT_HINTS = ("<", "#", ":", "：")


def may_advance(raw: str, known: int, *, max_sentences: int, max_chars: int, final: int | None = None) -> bool:
    """A cheap test before `final_sentences` on every streamed chunk: False when it cannot say more.

    `known`: how many sentences it already found final. Each final sentence holds an end mark
    (`。！？!?` or `.`) and the cleaner never adds one; so with no possible cut point, no more end
    marks than `known` (or than `final`, when only a complete line matters) and nothing over
    `max_chars`, there is nothing new to find. Most chunks stop here instead of running steps 1-5
    on the whole text again.
    """
    if any(hint in raw for hint in _CUT_HINTS) or ("[" in raw and "[inst" in raw.lower()):
        return True
    if 0 < max_chars < len(raw):
        return True
    ends = sum(raw.count(mark) for mark in END_MARKS) + raw.count(".")
    return ends > (known if final is None else max(1, final) - 1)


@dataclass(frozen=True)
class Progress:
    """What a streamed reply holds so far (see `final_sentences`)."""

    final: tuple[str, ...]  # the line's sentences that nothing later can change, in order
    emotion: Emotion  # the first emotion tag of the text so far
    complete: bool  # `final` is the whole line: nothing later can add to it


def final_sentences(
    raw_so_far: str,
    *,
    own_names: Sequence[str],
    other_speakers: Sequence[str] | OtherSpeakers,
    max_sentences: int,
    max_chars: int,
    ended: bool = False,
) -> Progress:
    """The sentences of the line that are final once `raw_so_far` has arrived (`ended`: all of it).

    Each is exactly the slice of the line `clean` makes of the whole raw text (a sentence after a
    space keeps the space in front), so the final sentences joined are always the start of that
    line, and once the line is complete they are the line. A sentence is final when
    - the stream has ended, or holds a cut point (a template marker, another speaker's label);
    - or the cleaned text has gone on past its end mark into the next sentence (after a bare end
      mark a closing bracket may still come, also after a stage direction: "ですね。<笑>」"; after
      a Latin "." a "5"; after a closed quote a quoting って), and no construct that a later
      character could still close or complete is open before its end: an unclosed `[` on the last
      line (a tag swallows what it encloses), an unclosed `（`/`(` (a narration at a line end is
      removed), an odd `*` on the last line, an open quote or one closed by the last character
      (a whole line in 「…」 loses its quotes, 「…」と keeps them), a speaker label that may be half
      written ("旅人" before "旅人1：" cuts, "みの" before "みのり：" is removed; "Dr. Kato:" even
      starts before the "Dr." that looks like a sentence);
    - or it is the first sentence and already over `max_chars` (it is final at the cut).
    A sentence that can no longer fit in `max_chars` ends the line before it. A line not yet
    complete holds back a sentence whose quote the whole line's finishing could still drop.
    """
    body = clean_body(raw_so_far, own_names, other_speakers)
    if ended or body.cut:
        kept, _ = fit_units(units(body.text)[0], max_sentences=max_sentences, max_chars=max_chars)
        return Progress(final=tuple(finish(kept)), emotion=body.emotion, complete=True)
    labels = _Labels(other_names(own_names, other_speakers), fold_names(own_names))
    settled = raw_so_far
    # Cutting at one open construct may open another (a "）" after it no longer closes its "（").
    while (open_at := _first_open(settled, labels)) < len(settled):
        settled = settled[:open_at]
    if len(settled) < len(raw_so_far):
        body = clean_body(settled, own_names, other_speakers)
    found, complete = units(body.text)
    if complete and _last_may_change(found, complete):
        complete -= 1
    final, line_complete = _kept_final(found, complete, max_sentences=max_sentences, max_chars=max_chars)
    if line_complete:
        return Progress(final=tuple(finish(final)), emotion=body.emotion, complete=True)
    while final and finish(final) != final:
        # A lone quote at the start (or end) would be dropped if the line ended here: wait.
        final = [] if finish(final)[:1] != final[:1] else final[:-1]
    return Progress(final=tuple(final), emotion=body.emotion, complete=False)


def _last_may_change(found: list[str], complete: int) -> bool:
    """Whether the last complete sentence may still change with what comes next.

    It may unless the text has gone on into the next sentence: after a bare end mark a closing
    bracket may still come (and after a stage direction too: "ですね。<笑>」"), after a Latin "."
    a "5" ("3.5"), after a closed quote a quoting って.
    """
    if len(found) == complete:
        return True
    return _may_continue(found[complete])


def _may_continue(rest: str) -> bool:
    """Whether what follows a sentence end may still turn into a quoting って (「本当？」って聞いた。)."""
    return rest.strip() == "っ"


def _kept_final(found: list[str], complete: int, *, max_sentences: int, max_chars: int) -> tuple[list[str], bool]:
    """The complete units the line keeps, and whether the line is complete with them."""
    wanted = max(1, max_sentences)
    kept, cut = fit_units(found[:complete], max_sentences=wanted, max_chars=max_chars)
    if cut:
        return kept, True
    if max_chars > 0 and complete < len(found) and len(kept) < wanted:
        # The next sentence is still arriving: once it is too long to fit, the line ends before it
        # (or, when it is the first, it is final at its cut). Its last character is left out: what
        # follows may still tidy it away (a space).
        fragment = found[complete]
        if len("".join([*kept, fragment[:-1]]).strip()) > max_chars:
            if kept:
                return kept, True
            return fit_units([fragment[:-1]], max_sentences=1, max_chars=max_chars)[0], True
    return kept, len(kept) >= wanted


@dataclass(frozen=True)
class _Labels:
    """Whose label a streamed tail may still become: another speaker's, or this NPC's own prefix."""

    others: OtherSpeakers
    own: frozenset[str]

    def may_begin(self, tail: str) -> bool:
        return self.others.may_become_label(tail) or any(may_become_label(tail, name) for name in self.own)


def _first_open(raw: str, labels: _Labels) -> int:
    """Where the first construct a later character could still change starts (else the length)."""
    line_start = raw.rfind("\n") + 1
    candidates = [len(raw), _open_label(raw, labels)]
    tag = raw.find("[", line_start)
    while tag != -1:
        if "]" not in raw[tag:]:
            candidates.append(tag)
            break
        tag = raw.find("[", tag + 1)
    # The character-by-character walks only where their characters occur (checked in C first).
    parens: list[int] = []
    if "（" in raw or "(" in raw:
        for index, char in enumerate(raw):
            if char in "（(":
                parens.append(index)
            elif char in "）)" and parens:
                parens.pop()
    candidates.extend(parens[:1])
    has_star = "*" in raw or "＊" in raw
    stars = [index for index in range(line_start, len(raw)) if raw[index] in "*＊"] if has_star else []
    if len(stars) % 2 == 1:
        candidates.append(stars[0])
    quote = open_quote(raw)
    stripped = raw.rstrip()
    if quote is None and stripped[-1:] in QUOTE_PAIRS.values():
        # A quote closed by the last character may be the whole line's (its quotes then go) or
        # be followed by more (「…」と): as open as before it closed.
        quote = open_quote(stripped[:-1])
    if quote is not None:
        candidates.append(quote)
    return min(candidates)


# Where a speaker label may start: a line start or a sentence end, then spaces and tags (as the
# cleaner's label pattern).
_BOUNDARY = re.compile(
    rf"(?:^|(?<=[{END_MARKS}.{CLOSERS}]))[ \t\u3000]*(?:\[[^\[\]\n]*\][ \t\u3000]*)*", re.MULTILINE
)


def _open_label(raw: str, labels: _Labels) -> int:
    """Where a speaker label may be half written at the end of `raw` ("…。旅人" before "旅人1："), else its length.

    Another speaker's label cuts the line from there, this NPC's own prefix at a line start is
    removed: either changes what the text after it looks like, and a name holding a sentence end
    ("Dr. Kato:") even the sentence before it. From there nothing is final until it is clear.
    """
    for boundary in _BOUNDARY.finditer(raw):
        tail = raw[boundary.end() :].casefold()
        if tail and labels.may_begin(tail):
            return boundary.start()
    return len(raw)


@dataclass(frozen=True)
class Cleaning:
    """The cleaner's options for one reply (this NPC's names, the other speakers, the limits), bound once."""

    own_names: tuple[str, ...]
    other_speakers: OtherSpeakers | tuple[str, ...]
    max_sentences: int
    max_chars: int

    def clean(self, raw: str) -> Cleaned:
        return clean(raw, **self._names(), max_sentences=self.max_sentences, max_chars=self.max_chars)

    def final(self, raw: str, *, ended: bool = False) -> Progress:
        return final_sentences(
            raw, **self._names(), max_sentences=self.max_sentences, max_chars=self.max_chars, ended=ended
        )

    def enough(self, raw: str) -> bool:
        return has_enough(raw, **self._names(), max_sentences=self.max_sentences, max_chars=self.max_chars)

    def may_advance(self, raw: str, known: int) -> bool:
        return may_advance(raw, known, max_sentences=self.max_sentences, max_chars=self.max_chars)

    def _names(self) -> dict[str, Any]:
        return {"own_names": self.own_names, "other_speakers": self.other_speakers}


_MEMORY_OPEN = re.compile(r"<\s*memory\s*>", re.IGNORECASE)
_MEMORY_CLOSE = re.compile(r"<\s*/\s*memory\s*>", re.IGNORECASE)
_BULLET = re.compile(r"\A(?:[-‐－・*•]|\d+[.)．])\s*")


def split_inline_memory(raw: str) -> tuple[str, list[str]]:
    """Split a reply with inline memory (characters.md `memory.extract: "inline"`).

    Returns the spoken part (every `<memory>…</memory>` block removed, and an unclosed `<memory>` to
    the end) and the memory lines: one per non-empty line inside the blocks, stripped, with a
    leading bullet (`- `, `・`, `* `, `1. `) removed. The lines are candidates: memory checks decide.
    Run it before `clean`.
    """
    spoken: list[str] = []
    lines: list[str] = []
    rest = raw
    while True:
        opening = _MEMORY_OPEN.search(rest)
        if opening is None:
            spoken.append(rest)
            break
        spoken.append(rest[: opening.start()])
        inside_and_after = rest[opening.end() :]
        closing = _MEMORY_CLOSE.search(inside_and_after)
        if closing is None:
            inside, rest = inside_and_after, ""
        else:
            inside, rest = inside_and_after[: closing.start()], inside_and_after[closing.end() :]
        for line in inside.splitlines():
            item = _BULLET.sub("", line.strip()).strip()
            if item:
                lines.append(item)
        if not rest:
            break
    return "".join(spoken), lines
