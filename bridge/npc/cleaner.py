"""Cleaning of raw model replies into the line an NPC speaks (replies.md "Cleaning", in its order).

Everything the model returns is untrusted text. `clean` runs the six steps of the contract:

1. Cut everything from the first chat-template marker on (`<|…`, `<assistant`, `<user`, `<system`
   (and their closing forms `</assistant` …), `<end_of_turn>`, `<start_of_turn>`, `</s>`, `<s>`,
   `[INST]`, `<<SYS>>`; case-insensitive; beyond the letter, the other templates' tokens of
   `bridge.markers` too). A role header at the very start (`assistant`, `model`,
   `Assistant:` alone on the first line) is removed, not cut after. Beyond the letter: a leading
   `Assistant:` / `model:` label followed by text on the same line is removed too.
   A marker at the very start leaves nothing: the reply is empty and the checks regenerate it.
   Beyond the letter: a markdown heading line (`# 話し方のルール`) is a cut point too — a model
   that starts one is writing a document or echoing its prompt, not speaking.
2. Cut from a line or sentence that starts with another speaker's name and `:`/`：` (optionally with
   `さん`/`様` and leading `[…]` tags). The other speakers are the caller's list (player name, other
   voiced characters' `name` and `speaker_name`) plus `ユーザー`, `User`, `プレイヤー`, always added
   here; Latin names match case-insensitively. A name that is also one of `own_names` is not an
   "other" speaker (a player may name themselves after the NPC).
3. Emotion: the first `[word]` tag whose word (case-insensitive, spaces trimmed) is an emotion or a
   VRM 0.x alias (`joy`→happy, `sorrow`→sad, `fun`→relaxed); else neutral. Then every `[…]` tag is
   removed, an unclosed `[` at the very end (a tag still arriving: up to 30 characters, no
   sentence end) is cut, and lone `[`/`]` left over are dropped.
4. Stage directions: `<…>`/`＜…＞` with mixed brackets; an unclosed one is cut to the end; a stray
   closing `>`/`＞` is dropped. `*…*`/`＊…＊` is removed (markdown bold `**…**` keeps its words; an
   unclosed `*` at the end is cut to the end; stray stars are dropped). A `（…）`/`(…)` is narration
   when it stands alone: preceded by the start, a line break or a sentence end, or followed only by
   whitespace up to the end of its line. Other parentheses belong to the sentence and stay
   ("映画（字幕版）は19時からです。"). An unclosed `（`/`(` at a sentence boundary is cut to the end.
   Beyond the letter: a `<think>…</think>` block (a reasoning model on a lane) goes with its content.
5. A leading `name:`/`speaker_name:` prefix of this NPC is removed (at the start and at each line
   start); quotes around a whole line (`「…」`, `『…』`, `"…"`, `“…”`, `‘…’`), and in step 6 around a
   whole sentence (「いらっしゃいませ。」「ごゆっくり。」), are removed; whitespace is
   tidied: runs (line breaks, full-width spaces) become one space, and spaces next to Japanese
   punctuation/brackets or before `, . ! ? ; : )` are dropped.
6. Sentences (`bridge.npc.sentences`): the first `max_sentences`, then at most `max_chars`
   characters.

What of a reply still being streamed is already final is `bridge.npc.streaming`'s job.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bridge.markers import first_template_marker
from bridge.npc.sentences import CLOSERS, END_MARKS, finish, fit_units, units, unquote
from bridge.npc.sentences import split_sentences as split_sentences
from bridge.speech import Emotion

# Step 2 always treats these as the other side of the conversation.
ALWAYS_OTHER_SPEAKERS: tuple[str, ...] = ("ユーザー", "User", "プレイヤー")

_SPACE = r"[ \t\u3000]"

# --- step 1 -------------------------------------------------------------------------------------
# A markdown heading line: the model is echoing its prompt or writing a document.
_HEADING = re.compile(r"(?m)^[ \t\u3000]*#{1,6}[ \t\u3000]")
# A list marker at a line start ("- 日本語で答える。"): speech has no bullets.
_LIST_MARKER = re.compile(r"(?m)^[ \t\u3000]*(?:[-‐－•][ \t\u3000]+|・[ \t\u3000]*)")
# "assistant" / "model" alone on the first line, or as a label with a colon.
_ROLE_HEADER = re.compile(r"\A\s*(?:assistant|model)[ \t\u3000]*(?:[:：]\s*|\n\s*|\Z)", re.IGNORECASE)

# --- step 3 -------------------------------------------------------------------------------------
_EMOTION_WORDS: dict[str, Emotion] = {
    "neutral": "neutral",
    "happy": "happy",
    "angry": "angry",
    "sad": "sad",
    "relaxed": "relaxed",
    "surprised": "surprised",
    # VRM 0.x names of the same expressions.
    "joy": "happy",
    "sorrow": "sad",
    "fun": "relaxed",
}
_TAG = re.compile(r"\[([^\[\]\n]*)\]")
_UNCLOSED_TAG = re.compile(r"\[[^\[\]\n。！？!?]{0,30}\Z")

# --- step 4 -------------------------------------------------------------------------------------
_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|\Z)", re.IGNORECASE | re.DOTALL)
_ANGLE = re.compile(r"[<＜][^<>＜＞]*[>＞]")
_UNCLOSED_ANGLE = re.compile(r"[<＜][^>＞]*\Z")
_BOLD = re.compile(r"\*\*([^*\n]+)\*\*")
_STAR = re.compile(r"[*＊][^*＊\n]*[*＊]")
_UNCLOSED_STAR = re.compile(r"[*＊][^*＊\n]*\Z")
_PAREN = re.compile(r"[（(][^（()）\n]*[）)]")
_UNCLOSED_PAREN = re.compile(r"[（(][^（()）]*\Z")
# Text before a parenthesis that makes it stand alone: nothing, a line break, or a sentence end.
_BOUNDARY_BEFORE = re.compile(rf"(?:\A|\n|[{END_MARKS}.][{CLOSERS}]*){_SPACE}*\Z")
_LINE_END_AFTER = re.compile(rf"\A{_SPACE}*(?:\n|\Z)")


@dataclass(frozen=True)
class Cleaned:
    """A cleaned reply: the text to speak (may be empty) and its emotion."""

    text: str
    emotion: Emotion


@dataclass(frozen=True)
class Body:
    text: str  # after steps 1-5
    emotion: Emotion
    cut: bool  # a cut point (template marker or another speaker's line) was found


# A speaker label at a line or sentence start: `[tag] name(さん|様|さま)? :`. One pattern for every set of
# names; whether a label cuts is decided by its name in code. (An alternation of the names compiled
# per player was paid on the first reply to every new player.)
_MAX_LABEL_CHARS = 64
_LABEL = re.compile(
    rf"(?:^|(?<=[{END_MARKS}.{CLOSERS}])){_SPACE}*(?:\[[^\[\]\n]*\]{_SPACE}*)*"
    rf"(?P<name>[^\n:：]{{1,{_MAX_LABEL_CHARS}}}?){_SPACE}*[:：]",
    re.MULTILINE,
)
HONORIFICS = ("さん", "様", "さま")


def _fold(name: str) -> str:
    return name.strip().casefold()


@dataclass(frozen=True)
class OtherSpeakers:
    """Whose labels cut a reply in step 2, case-folded; `in` tells whether a label names one of them.

    Built once per character (`of`, from every voiced character's names: the roster does it at start
    and at reload); the player's name is added per reply (`with_player`). Both are O(1) per reply in
    the size of the cast: the big set is shared, never copied, and own names are excluded on lookup.
    """

    names: frozenset[str]  # may hold this NPC's own names too: they are excluded on lookup
    own: frozenset[str] = frozenset()
    player: str = ""
    # The names holding a sentence end or a closer ("Dr. Kato"): the few a label check while streaming
    # must look at one by one. Computed with `names`, so no reply walks the cast to find them.
    spanning_names: frozenset[str] = frozenset()
    # Every start of every name ("旅", "旅人", "旅人1"): whether a streamed tail may still grow into a
    # label is one lookup, not a walk over the cast (bridge.npc.streaming).
    prefixes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: Iterable[str], *, own_names: Iterable[str] = ()) -> OtherSpeakers:
        folded = fold_names((*names, *ALWAYS_OTHER_SPEAKERS))
        prefixes = frozenset(name[:end] for name in folded for end in range(1, len(name) + 1))
        return cls(
            names=folded,
            own=fold_names(own_names),
            spanning_names=frozenset(filter(_spans, folded)),
            prefixes=prefixes,
        )

    def with_own(self, own_names: Iterable[str]) -> OtherSpeakers:
        return dataclasses.replace(self, own=fold_names(own_names))

    def with_player(self, player_name: str) -> OtherSpeakers:
        return dataclasses.replace(self, player=_fold(player_name))

    @property
    def spanning(self) -> list[str]:
        """Other speakers' names holding a sentence end or a closer (own names left out)."""
        found = [name for name in self.spanning_names if name not in self.own]
        return [*found, self.player] if self.player in self and _spans(self.player) else found

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not name or name in self.own:
            return False
        return name in self.names or name == self.player

    def may_become_label(self, tail: str) -> bool:
        """Whether `tail` (case-folded, after a boundary) may still grow into one of these names' labels:
        the start of a name, or a whole name then the start of an honorific. Own names count too here
        (their prefix is removed, which changes the text after it just as much)."""
        if tail in self.prefixes or (self.player and may_become_label(tail, self.player)):
            return True
        for end in range(1, min(len(tail), _MAX_LABEL_CHARS) + 1):
            if tail[:end] in self.names and may_become_label(tail, tail[:end]):
                return True
        return False


def may_become_label(tail: str, name: str) -> bool:
    """Whether `tail` is the start of `name`'s label: of the name, or the name and of an honorific."""
    if name.startswith(tail):
        return True
    after = tail[len(name) :].strip(" \t\u3000") if tail.startswith(name) else None
    return after is not None and any(honorific.startswith(after) for honorific in ("", *HONORIFICS))


def _spans(name: str) -> bool:
    return any(char in name for char in END_MARKS + "." + CLOSERS)


def fold_names(names: Iterable[str]) -> frozenset[str]:
    """The names as step 2 compares them (trimmed, case-folded), empty ones dropped."""
    return frozenset(folded for name in names if name and (folded := _fold(name)))


def _is_other(label: str, others: OtherSpeakers) -> bool:
    name = _fold(label)
    if name in others:
        return True
    return any(name.endswith(h) and name[: -len(h)].rstrip() in others for h in HONORIFICS)


def other_names(own_names: Sequence[str], other_speakers: Sequence[str] | OtherSpeakers) -> OtherSpeakers:
    """Whose labels cut: `other_speakers` as given on the reply path, or built from a list of names."""
    if isinstance(other_speakers, OtherSpeakers):
        return other_speakers
    return OtherSpeakers.of(other_speakers, own_names=own_names)


def _other_label_start(text: str, others: OtherSpeakers) -> int | None:
    """Where the first label of another speaker starts, if any."""
    position = 0
    # Labels are tried at every boundary, overlapping ones included ("Dr. Kato:" holds a boundary).
    while (found := _LABEL.search(text, position)) is not None:
        if _is_other(found.group("name"), others):
            return found.start()
        position = found.start() + 1
    return None


# A leading `name:` at a line start; whether it is this NPC's own prefix is decided by the name in code,
# so no pattern is compiled per character.
_PREFIX = re.compile(rf"\A{_SPACE}*(?P<name>[^\n:：]{{1,{_MAX_LABEL_CHARS}}}?){_SPACE}*[:：]{_SPACE}*")


def _strip_own_prefix(text: str, own: frozenset[str]) -> str:
    found = _PREFIX.match(text)
    return text[found.end() :] if found is not None and _fold(found.group("name")) in own else text


def _cut_markers(raw: str) -> tuple[str, bool]:
    """Step 1."""
    text = _ROLE_HEADER.sub("", raw, count=1)
    heading = _HEADING.search(text)
    cuts = [at for at in (first_template_marker(text), heading.start() if heading else None) if at is not None]
    if not cuts:
        return text, False
    return text[: min(cuts)], True


def _cut_other_speakers(text: str, others: OtherSpeakers) -> tuple[str, bool]:
    """Step 2."""
    start = _other_label_start(text, others)
    if start is None:
        return text, False
    return text[:start], True


def _take_emotion(text: str) -> tuple[str, Emotion]:
    """Step 3."""
    emotion: Emotion = "neutral"
    for tag in _TAG.finditer(text):
        word = tag.group(1).strip().casefold()
        if word in _EMOTION_WORDS:
            emotion = _EMOTION_WORDS[word]
            break
    text = _UNCLOSED_TAG.sub("", _TAG.sub("", text))
    # Lone square brackets left over belong to no tag and are never spoken.
    return text.replace("[", "").replace("]", ""), emotion


def _remove_until_stable(pattern: re.Pattern[str], text: str, replacement: str = "") -> str:
    while True:
        new = pattern.sub(replacement, text)
        if new == text:
            return text
        text = new


def _drop_narration(text: str) -> str:
    """Remove `（…）` that stands alone (step 4); repeated, since one removal can free the next."""
    changed = True
    while changed:
        changed = False
        for paren in _PAREN.finditer(text):
            before, after = text[: paren.start()], text[paren.end() :]
            if _BOUNDARY_BEFORE.search(before) or _LINE_END_AFTER.match(after):
                # A space keeps "Hello. (smiles) Bye." two sentences; tidying drops needless ones.
                text = f"{before} {after}"
                changed = True
                break
    unclosed = _UNCLOSED_PAREN.search(text)
    if unclosed is not None and _BOUNDARY_BEFORE.search(text[: unclosed.start()]):
        text = text[: unclosed.start()]
    return text


def _remove_stage_directions(text: str) -> str:
    """Step 4."""
    text = _THINK_BLOCK.sub("", text)
    text = _remove_until_stable(_ANGLE, text)
    text = _UNCLOSED_ANGLE.sub("", text)
    text = text.replace(">", "").replace("＞", "")
    text = _BOLD.sub(r"\1", text)
    text = _STAR.sub("", text)
    text = _UNCLOSED_STAR.sub("", text)
    text = text.replace("*", "").replace("＊", "")
    return _drop_narration(text)


def _is_tight(char: str) -> bool:
    """Japanese punctuation, brackets and symbols: no space belongs next to them."""
    return ord(char) > 0x2000 and unicodedata.category(char)[0] in "PS"


def _tidy_whitespace(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if " " not in text:  # most Japanese lines: nothing to look at character by character
        return text
    out: list[str] = []
    for index, char in enumerate(text):
        if char == " ":
            before, after = text[index - 1], text[index + 1]
            if _is_tight(before) or _is_tight(after) or after in ",.!?;:)" or before in "([":
                continue
        out.append(char)
    return "".join(out)


def _speaker_and_quotes(text: str, own: frozenset[str]) -> str:
    """Step 5."""
    lines = [unquote(_strip_own_prefix(line, own)) for line in text.split("\n")]
    text = _strip_own_prefix(_tidy_whitespace("\n".join(lines)), own)
    return unquote(text)


def clean_body(raw: str, own_names: Sequence[str], other_speakers: Sequence[str] | OtherSpeakers) -> Body:
    """Steps 1-5: the tidied text (not yet cut into sentences), its emotion, whether a cut point was found."""
    text, cut_marker = _cut_markers(raw)
    text, cut_speaker = _cut_other_speakers(text, other_names(own_names, other_speakers))
    text, emotion = _take_emotion(text)
    text = _remove_stage_directions(text)
    text = _LIST_MARKER.sub("", text)
    text = _speaker_and_quotes(text, fold_names(own_names))
    # Again, for narration that stood alone only once the prefix was gone ("みのり：（微笑む）はい。").
    text = _tidy_whitespace(_drop_narration(text))
    return Body(text=text, emotion=emotion, cut=cut_marker or cut_speaker)


def clean(
    raw: str,
    *,
    own_names: Sequence[str],
    other_speakers: Sequence[str] | OtherSpeakers,
    max_sentences: int,
    max_chars: int,
) -> Cleaned:
    """Clean a complete raw reply (see the module docstring for the rules, in order).

    `own_names`: this NPC's `name` and `speaker_name`. `other_speakers`: the player's `playerName`
    and the other voiced characters' `name`/`speaker_name` (`ユーザー`, `User`, `プレイヤー` are added
    here); on the reply path an `OtherSpeakers` built once per character, so no reply walks the cast.
    The result may be empty (the raw text was only a stage direction, a marker, …); the
    checks then ask for a regeneration. Run `split_inline_memory` first for inline-memory characters.
    """
    body = clean_body(raw, own_names, other_speakers)
    found, _ = units(body.text)
    kept, _ = fit_units(found, max_sentences=max_sentences, max_chars=max_chars)
    spoken = finish(kept)
    return Cleaned(text="".join(spoken), emotion=body.emotion)
