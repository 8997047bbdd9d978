"""Step 6 of the cleaning (replies.md "Cleaning"): tidied text → the sentences the NPC speaks.

Pure text functions on the output of steps 1-5 (`bridge.npc.cleaner`). Sentences end at `。！？!?`
runs (and, for English characters, at a Latin `.` that is not part of `..`/`...` and is followed by
a space, the end, or a non-ASCII character, not by `5` in `3.5`), with the closing quotes/brackets
that follow (`」』）)”’"'〉》】`), except when a closing bracket is followed by a quoting `と`/`って`
(「本当ですか？」と聞かれました。 is one sentence); `…`/`……` do not end a sentence. The first
`max_sentences` are kept; a final fragment without an end mark counts as a sentence because the text
is complete. Then at most `max_chars` characters: whole sentences are kept while they fit; when not
even the first fits, it is cut before the last `、`, `，`, `,` or space within the limit, else at the
limit. A sentence quoted on its own (「いらっしゃいませ。」「ごゆっくり。」) loses its quotes; a quote
left unbalanced by a cut (`「…` with its `」` cut off) loses its lone bracket.

The kept sentences are returned as *units*: each is exactly the slice of the final line it occupies
(a sentence after a space keeps that space in front: "Hello." + " How are you?"), so the units
joined are the line, character for character. Sentence-by-sentence speaking (`npc:say:part`) sends
these units.
"""

from __future__ import annotations

import re

END_MARKS = "。！？!?"
CLOSERS = "」』）)”’\"'〉》】"
QUOTE_PAIRS: dict[str, str] = {"「": "」", "『": "』", "“": "”", "‘": "’", '"': '"', "＂": "＂"}

# End marks (possessive: a run is one end), then all closing brackets; a quote closed and followed
# by a quoting particle (「本当ですか？」と聞く) continues the sentence.
_SENTENCE_END = re.compile(
    rf"(?:[{END_MARKS}]++|(?<!\.)\.(?=\s|\Z|[^\x00-\x7f]|[{CLOSERS}]))"
    rf"(?:[{CLOSERS}]++(?!と|って)|(?![{CLOSERS}]))"
)
_CUT_POINTS = "、，, "


def split_sentences(text: str) -> tuple[list[str], str]:
    """Split tidied text into complete sentences (each with its end mark and closers) and the rest."""
    sentences: list[str] = []
    start = 0
    for end in _SENTENCE_END.finditer(text):
        sentences.append(text[start : end.end()])
        start = end.end()
    return sentences, text[start:]


def encloses_whole(text: str, opener: str, closer: str) -> bool:
    """Whether the opener at text[0] is closed by the closer at text[-1] (not earlier)."""
    if opener == closer:
        return text.count(opener) == 2
    depth = 0
    for index, char in enumerate(text):
        if char == opener:
            depth += 1
        elif char == closer:
            depth -= 1
            if depth == 0:
                return index == len(text) - 1
    return False


def unquote(line: str) -> str:
    """`line` stripped, without quotes around the whole of it (repeatedly: 「『…』」)."""
    text = line.strip()
    while len(text) >= 2 and text[0] in QUOTE_PAIRS:
        opener = text[0]
        closer = QUOTE_PAIRS[opener]
        if text[-1] != closer or not encloses_whole(text, opener, closer):
            break
        text = text[1:-1].strip()
    return text


def units(text: str) -> tuple[list[str], int]:
    """All sentence units of tidied text, each quoted-alone sentence unquoted, and how many are complete.

    The last unit is the fragment without an end mark, when there is one (it is not complete).
    """
    complete, rest = split_sentences(text)
    found = [*complete, rest] if rest.strip() else complete
    # A sentence quoted on its own (「いらっしゃいませ。」「ごゆっくり。」) is a line in quotes too.
    return [unit[: len(unit) - len(unit.lstrip())] + unquote(unit) for unit in found], len(complete)


def fit_units(found: list[str], *, max_sentences: int, max_chars: int) -> tuple[list[str], bool]:
    """The units the line keeps (before `finish`), and whether the character limit ended the line.

    Whole units are kept while they fit in `max_chars`; when not even the first fits, it is cut
    before its last pause within the limit.
    """
    kept = found[: max(1, max_sentences)]
    if not kept or max_chars <= 0:
        return kept, False
    fitting: list[str] = []
    for unit in kept:
        if len("".join([*fitting, unit]).strip()) > max_chars:
            return (fitting, True) if fitting else ([_cut_sentence(unit, max_chars)], True)
        fitting.append(unit)
    return fitting, False


def _cut_sentence(sentence: str, max_chars: int) -> str:
    window = sentence.strip()[:max_chars]
    pause = max(window.rfind(mark) for mark in _CUT_POINTS)
    return window[:pause] if pause > 0 else window


def finish(kept: list[str]) -> list[str]:
    """The kept units as slices of the final line: ends stripped, lone quotes at the ends dropped."""
    joined = "".join(kept)
    front, back = _trim(joined)
    out: list[str] = []
    offset = 0
    for unit in kept:
        start, end = max(offset, front), min(offset + len(unit), len(joined) - back)
        if end > start:
            out.append(joined[start:end])
        offset += len(unit)
    return out


def _trim(text: str) -> tuple[int, int]:
    """How many characters `finish` drops at the front and at the back of the joined line."""
    if not text.strip():
        return len(text), 0
    front = len(text) - len(text.lstrip())
    back = len(text) - len(text.rstrip())
    for opener, closer in QUOTE_PAIRS.items():
        inner = text[front : len(text) - back]
        if opener == closer:
            if inner.count(opener) % 2 == 1:
                if inner.startswith(opener):
                    front += 1
                elif inner.endswith(opener):
                    back += 1
            continue
        if inner.startswith(opener) and inner.count(opener) > inner.count(closer):
            front += 1
            inner = inner[1:]
        if inner.endswith(closer) and inner.count(closer) > inner.count(opener):
            back += 1
    # A dropped quote may leave a space at the end it was on.
    inner = text[front : len(text) - back]
    return front + len(inner) - len(inner.lstrip()), back + len(inner) - len(inner.rstrip())


def open_quote(text: str) -> int | None:
    """Where the first quote of `text` that is still open starts (None: every quote is closed).

    A closing quote may still come for it, and whether it does changes how the sentences from there
    on are cleaned (a whole line in quotes loses them; 「…」と keeps them).
    """
    first: int | None = None
    for opener, closer in QUOTE_PAIRS.items():
        if opener not in text:  # a closer alone opens nothing; most lines hold no quote at all
            continue
        if opener == closer:
            positions = [index for index, char in enumerate(text) if char == opener]
            found = positions[-1] if len(positions) % 2 == 1 else None
        else:
            stack: list[int] = []
            for index, char in enumerate(text):
                if char == opener:
                    stack.append(index)
                elif char == closer and stack:
                    stack.pop()
            found = stack[0] if stack else None
        if found is not None and (first is None or found < first):
            first = found
    return first
