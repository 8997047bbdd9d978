"""Checks on a cleaned reply (replies.md "Checks"): the rule it breaks, and the hint for a second try.

Rules, in the order they are tried (the first that fails is returned):
- ``empty``: nothing but whitespace.
- ``banned_word``: contains a banned word (global list + the character's), compared after NFKC and
  case folding, as a substring.
- ``repeat``: equals the last line this NPC said to this player, compared after NFKC, case folding
  and with all whitespace removed.
- ``language``: not in the character's language. "Letters" are the characters whose Unicode
  category is a letter (L*): kana (with ー and 々), kanji, Latin letters, and any other script's
  letters (Hangul, Cyrillic, … count against both languages). Digits, punctuation, symbols, emoji
  and spaces are ignored. Japanese fails when fewer than half of the letters are kana/kanji;
  English fails when fewer than half are Latin. A reply with no letters at all ("……。") fails.
  The text is NFKC-normalised first, so half-width katakana and full-width Latin count as such.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Literal

from bridge.compare import copies_run

Language = Literal["ja", "en"]

RULE_EMPTY = "empty"
RULE_BANNED_WORD = "banned_word"
RULE_REPEAT = "repeat"
RULE_LANGUAGE = "language"
RULE_ECHO = "echo"
# A reply holding this many characters in a row from the model's own instructions is an echo of the
# prompt (small models do it), not speech. Long enough that ordinary phrases do not trip it.
ECHO_RUN_CHARS = 12

_HINTS_JA: dict[str, str] = {
    RULE_EMPTY: "セリフだけを、短い一言で答えてください。",
    RULE_BANNED_WORD: "使ってはいけない言葉を避けて、別の言い方で短く答えてください。",
    RULE_REPEAT: "前と同じ言い方を避けて、別の言葉で短く答えてください。",
    RULE_LANGUAGE: "日本語だけで、短く答えてください。",
    RULE_ECHO: "説明やルールを繰り返さず、お客さんへのセリフだけを短く答えてください。",
}
_HINTS_EN: dict[str, str] = {
    RULE_EMPTY: "Answer with a short spoken line only.",
    RULE_BANNED_WORD: "Avoid the words you must not use, and answer briefly in other words.",
    RULE_REPEAT: "Do not repeat what you said before; answer briefly in other words.",
    RULE_LANGUAGE: "Answer briefly, in English only.",
    RULE_ECHO: "Do not repeat your instructions; answer the customer briefly.",
}
_HINT_OTHER_JA = "もう一度、短く自然に答えてください。"
_HINT_OTHER_EN = "Please answer again, briefly and naturally."


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def _is_kana_or_kanji(char: str) -> bool:
    code = ord(char)
    return (
        0x3040 <= code <= 0x30FF  # hiragana, katakana (ー included)
        or 0x31F0 <= code <= 0x31FF  # katakana phonetic extensions
        or 0x3400 <= code <= 0x4DBF  # CJK extension A
        or 0x4E00 <= code <= 0x9FFF  # CJK unified ideographs
        or 0xF900 <= code <= 0xFAFF  # CJK compatibility ideographs
        or 0x20000 <= code <= 0x3FFFF  # CJK extensions B and later
        or char in "々〆ヵヶ"
    )


def _is_latin(char: str) -> bool:
    return "LATIN" in unicodedata.name(char, "")


def letter_counts(text: str) -> tuple[int, int, int]:
    """(letters, kana/kanji, Latin) in the NFKC form of `text`; see the module docstring."""
    letters = japanese = latin = 0
    for char in unicodedata.normalize("NFKC", text):
        if not unicodedata.category(char).startswith("L"):
            continue
        letters += 1
        if _is_kana_or_kanji(char):
            japanese += 1
        elif _is_latin(char):
            latin += 1
    return letters, japanese, latin


def in_language(text: str, language: Language) -> bool:
    """Whether at least half of the letters of `text` are of `language`'s script."""
    letters, japanese, latin = letter_counts(text)
    if letters == 0:
        return False
    own = japanese if language == "ja" else latin
    return own * 2 >= letters


def check_reply(
    text: str, *, banned: Iterable[str], last_line: str | None, language: Language, instructions: str = ""
) -> str | None:
    """The first rule `text` breaks (`empty`, `banned_word`, `repeat`, `language`, `echo`), or None.

    `echo` (beyond replies.md): the reply copies a run of its own instructions (the system message
    without the world's lines) — a small model reciting its prompt.
    """
    if not text.strip():
        return RULE_EMPTY
    normalised = _normalise(text)
    for word in banned:
        needle = _normalise(word).strip()
        if needle and needle in normalised:
            return RULE_BANNED_WORD
    if repeats(text, last_line):
        return RULE_REPEAT
    if not in_language(text, language):
        return RULE_LANGUAGE
    if instructions and copies_run(text, instructions, run_chars=ECHO_RUN_CHARS):
        return RULE_ECHO
    return None


def check_sentence(text: str, *, banned: Iterable[str], language: Language, instructions: str = "") -> str | None:
    """The first rule one sentence of a reply breaks, said on its own (`npc:say:part`), or None.

    The rules of `check_reply` but the repeat rule, which is for the whole line (replies.md,
    "Sentence by sentence").
    """
    return check_reply(text, banned=banned, last_line=None, language=language, instructions=instructions)


def _compact(text: str) -> str:
    return "".join(_normalise(text).split())


def repeats(text: str, last_line: str | None) -> bool:
    """Whether `text` equals `last_line` as the repeat rule compares them."""
    return last_line is not None and _compact(text) == _compact(last_line)


def may_repeat(start: str, last_line: str | None) -> bool:
    """Whether a line that starts with `start` may still turn out equal to `last_line`."""
    return last_line is not None and _compact(last_line).startswith(_compact(start))


def regeneration_hint(rule: str, *, language: Language = "ja") -> str:
    """The short hint appended to the player's line for the second try after `rule` failed."""
    hints, other = (_HINTS_JA, _HINT_OTHER_JA) if language == "ja" else (_HINTS_EN, _HINT_OTHER_EN)
    return hints.get(rule, other)
