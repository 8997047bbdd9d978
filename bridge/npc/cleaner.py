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
6. Sentences end at `。！？!?` runs (and, for English characters, at a Latin `.` that is not part of
   `..`/`...` and is followed by a space, the end, or a non-ASCII character, not by `5` in `3.5`),
   with the closing quotes/brackets that follow (`」』）)”’"'〉》】`), except when a closing bracket
   is followed by a quoting `と`/`って` (「本当ですか？」と聞かれました。 is one sentence);
   `…`/`……` do not end a sentence. The first
   `max_sentences` are kept; a final fragment without an end mark counts as a sentence because the
   text is complete. Then at most `max_chars` characters: whole sentences are kept while they fit;
   when not even the first fits, it is cut before the last `、`, `，`, `,` or space within the limit,
   else at the limit. A quote left unbalanced by a cut (`「…` with its `」` cut off) loses its lone
   bracket.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bridge.markers import first_template_marker
from bridge.speech import Emotion

# Step 2 always treats these as the other side of the conversation.
ALWAYS_OTHER_SPEAKERS: tuple[str, ...] = ("ユーザー", "User", "プレイヤー")

_END_MARKS = "。！？!?"
_CLOSERS = "」』）)”’\"'〉》】"
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
_BOUNDARY_BEFORE = re.compile(rf"(?:\A|\n|[{_END_MARKS}.][{_CLOSERS}]*){_SPACE}*\Z")
_LINE_END_AFTER = re.compile(rf"\A{_SPACE}*(?:\n|\Z)")

# --- step 5 -------------------------------------------------------------------------------------
_QUOTE_PAIRS: dict[str, str] = {"「": "」", "『": "』", "“": "”", "‘": "’", '"': '"', "＂": "＂"}

# --- step 6 -------------------------------------------------------------------------------------
# End marks (possessive: a run is one end), then all closing brackets; a quote closed and followed
# by a quoting particle (「本当ですか？」と聞く) continues the sentence.
_SENTENCE_END = re.compile(
    rf"(?:[{_END_MARKS}]++|(?<!\.)\.(?=\s|\Z|[^\x00-\x7f]|[{_CLOSERS}]))"
    rf"(?:[{_CLOSERS}]++(?!と|って)|(?![{_CLOSERS}]))"
)
_CUT_POINTS = "、，, "


@dataclass(frozen=True)
class Cleaned:
    """A cleaned reply: the text to speak (may be empty) and its emotion."""

    text: str
    emotion: Emotion


@dataclass(frozen=True)
class _Body:
    text: str  # after steps 1-5
    emotion: Emotion
    cut: bool  # a cut point (template marker or another speaker's line) was found


# A speaker label at a line or sentence start: `[tag] name(さん|様|さま)? :`. One pattern for every set of
# names; whether a label cuts is decided by its name in code. (An alternation of the names compiled
# per player was paid on the first reply to every new player.)
_MAX_LABEL_CHARS = 64
_LABEL = re.compile(
    rf"(?:^|(?<=[{_END_MARKS}.{_CLOSERS}])){_SPACE}*(?:\[[^\[\]\n]*\]{_SPACE}*)*"
    rf"(?P<name>[^\n:：]{{1,{_MAX_LABEL_CHARS}}}?){_SPACE}*[:：]",
    re.MULTILINE,
)
_HONORIFICS = ("さん", "様", "さま")


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

    @classmethod
    def of(cls, names: Iterable[str], *, own_names: Iterable[str] = ()) -> OtherSpeakers:
        folded = fold_names((*names, *ALWAYS_OTHER_SPEAKERS))
        return cls(names=folded, own=fold_names(own_names), spanning_names=frozenset(filter(_spans, folded)))

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


def _spans(name: str) -> bool:
    return any(char in name for char in _END_MARKS + "." + _CLOSERS)


def fold_names(names: Iterable[str]) -> frozenset[str]:
    """The names as step 2 compares them (trimmed, case-folded), empty ones dropped."""
    return frozenset(folded for name in names if name and (folded := _fold(name)))


def _is_other(label: str, others: OtherSpeakers) -> bool:
    name = _fold(label)
    if name in others:
        return True
    return any(name.endswith(h) and name[: -len(h)].rstrip() in others for h in _HONORIFICS)


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


def _encloses_whole(text: str, opener: str, closer: str) -> bool:
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


def _unquote(line: str) -> str:
    text = line.strip()
    while len(text) >= 2 and text[0] in _QUOTE_PAIRS:
        opener = text[0]
        closer = _QUOTE_PAIRS[opener]
        if text[-1] != closer or not _encloses_whole(text, opener, closer):
            break
        text = text[1:-1].strip()
    return text


def _is_tight(char: str) -> bool:
    """Japanese punctuation, brackets and symbols: no space belongs next to them."""
    return ord(char) > 0x2000 and unicodedata.category(char)[0] in "PS"


def _tidy_whitespace(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
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
    lines = [_unquote(_strip_own_prefix(line, own)) for line in text.split("\n")]
    text = _strip_own_prefix(_tidy_whitespace("\n".join(lines)), own)
    return _unquote(text)


def _body(raw: str, own_names: Sequence[str], other_speakers: Sequence[str] | OtherSpeakers) -> _Body:
    """Steps 1-5."""
    text, cut_marker = _cut_markers(raw)
    text, cut_speaker = _cut_other_speakers(text, other_names(own_names, other_speakers))
    text, emotion = _take_emotion(text)
    text = _remove_stage_directions(text)
    text = _LIST_MARKER.sub("", text)
    text = _speaker_and_quotes(text, fold_names(own_names))
    # Again, for narration that stood alone only once the prefix was gone ("みのり：（微笑む）はい。").
    text = _tidy_whitespace(_drop_narration(text))
    return _Body(text=text, emotion=emotion, cut=cut_marker or cut_speaker)


def split_sentences(text: str) -> tuple[list[str], str]:
    """Split tidied text into complete sentences (each with its end mark and closers) and the rest."""
    sentences: list[str] = []
    start = 0
    for end in _SENTENCE_END.finditer(text):
        sentences.append(text[start : end.end()])
        start = end.end()
    return sentences, text[start:]


def _cut_to_chars(sentences: list[str], max_chars: int) -> list[str]:
    kept: list[str] = []
    for sentence in sentences:
        if len("".join([*kept, sentence]).strip()) > max_chars:
            break
        kept.append(sentence)
    if kept:
        return kept
    # Not even the first sentence fits: cut it before its last pause within the limit.
    window = sentences[0].strip()[:max_chars]
    pause = max(window.rfind(mark) for mark in _CUT_POINTS)
    return [window[:pause] if pause > 0 else window]


def _balance_quotes(text: str) -> str:
    """Drop a lone opening quote at the start or closing quote at the end left by a cut."""
    for opener, closer in _QUOTE_PAIRS.items():
        if opener == closer:
            if text.count(opener) % 2 == 1:
                if text.startswith(opener):
                    text = text[1:]
                elif text.endswith(opener):
                    text = text[:-1]
            continue
        if text.startswith(opener) and text.count(opener) > text.count(closer):
            text = text[1:]
        if text.endswith(closer) and text.count(closer) > text.count(opener):
            text = text[:-1]
    return text.strip()


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
    body = _body(raw, own_names, other_speakers)
    complete, rest = split_sentences(body.text)
    units = [*complete, rest] if rest.strip() else complete
    # A sentence quoted on its own (「いらっしゃいませ。」「ごゆっくり。」) is a line in quotes too.
    units = [unit[: len(unit) - len(unit.lstrip())] + _unquote(unit) for unit in units]
    kept = units[: max(1, max_sentences)]
    if kept and max_chars > 0:
        kept = _cut_to_chars(kept, max_chars)
    return Cleaned(text=_balance_quotes("".join(kept).strip()), emotion=body.emotion)


def has_enough(
    raw_so_far: str,
    *,
    own_names: Sequence[str],
    other_speakers: Sequence[str] | OtherSpeakers,
    max_sentences: int,
) -> bool:
    """Whether reading the stream can stop now: what is still to come would be cut anyway.

    True as soon as either
    - the raw text holds a cut point: a complete template marker (step 1) or another speaker's
      label with its colon at a line or sentence start (step 2): everything after is cut anyway; or
    - the cleaned text (steps 1-5 on what arrived so far) holds `max_sentences` *complete* sentences.
    Then call `clean` on the text received so far. (An emotion tag the model would only have
    written after those sentences is missed: models put it first.)

    A sentence is complete only when something other than more end marks, closing quotes/brackets
    or whitespace came after its end mark: "ですね。" may still get its "」", so the last sentence
    end counts only when the raw text does not end in an end mark, a closing bracket/quote or
    whitespace; a Latin "." ending the cleaned text also waits for what follows ("3.5", "...").
    This is conservative: a narration "（微笑む）" at the end also waits for one more character.
    A trailing fragment without an end mark never counts. What the cleaner cuts while it is still
    open never counts either: the text inside an unclosed `<…` / `＜…` (a stage direction or a
    half-received marker such as "<assist"), an unclosed `[` tag or `*`, or a narration `（` at a
    sentence boundary.

    For a character with inline memory (`memory.extract: "inline"`), stopping early would lose the
    `<memory>` block written after the reply: read such a stream to its end.
    """
    if not _may_have_enough(raw_so_far, max_sentences):
        return False
    return _has_enough(raw_so_far, own_names=own_names, other_speakers=other_speakers, max_sentences=max_sentences)


# What every cut point holds: a template marker `<` or `[INST]`, a heading `#`, a label's colon.
_CUT_HINTS = ("<", "#", ":", "：")


def _may_have_enough(raw: str, max_sentences: int) -> bool:
    """A cheap test `has_enough` runs first, on every streamed chunk: False only when it would be False.

    Each complete sentence holds an end mark (`。！？!?` or `.`), and the cleaner never adds one; so
    with no possible cut point and fewer end marks than the sentences wanted, there is nothing to
    find. Most chunks stop here instead of running steps 1-5 on the whole text again.
    """
    if any(hint in raw for hint in _CUT_HINTS) or ("[" in raw and "[inst" in raw.lower()):
        return True
    ends = sum(raw.count(mark) for mark in _END_MARKS) + raw.count(".")
    return ends >= max(1, max_sentences)


def _has_enough(
    raw_so_far: str, *, own_names: Sequence[str], other_speakers: Sequence[str] | OtherSpeakers, max_sentences: int
) -> bool:
    body = _body(raw_so_far, own_names, other_speakers)
    if body.cut:
        return True
    complete, rest = split_sentences(body.text)
    count = len(complete)
    tail = raw_so_far[-1:]
    if count and not rest.strip():
        # The last end mark may still get its closing bracket; a Latin "." at the end is an end only
        # if what comes next is a space (it may turn out to be "3.5" or "...").
        waiting = tail in _END_MARKS or tail in _CLOSERS or tail == "." or tail.isspace()
        if waiting or complete[-1].rstrip(_CLOSERS).endswith("."):
            count -= 1
    return count >= max(1, max_sentences)


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
