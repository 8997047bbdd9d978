"""Final sentences of a streamed reply (replies.md "Sentence by sentence").

The property that matters: whatever the chunking, the sentences announced as final while the raw
text arrives are never taken back, and once the stream is read (to its end, or until `has_enough`)
they joined are exactly the whole-line cleaning of the same raw text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bridge.npc.cleaner import clean
from bridge.npc.sentences import units
from bridge.npc.streaming import Progress, final_sentences, has_enough, split_inline_memory

SHARED_EXAMPLES = Path("/work/shared/examples/raw-replies.jsonl")
OWN = ("カフェのみのり", "みのり")
OTHERS = ("旅人1", "Dr. Kato")
CHUNKS = (1, 2, 3, 5, 8)

# Beyond the shared examples: the constructs a later character can still change.
HARD_RAWS = (
    "「本当ですか？」と聞かれました。はい、本当です。",
    "「本当？」って聞いたよ。そうなの。",
    "「いらっしゃいませ。」「ごゆっくり。」",
    "「A。B。」C。",
    "はい。[motion:bow。]どうぞ。次も。",
    "映画（字幕版。です）は七時から。ぜひ。",
    "はい。（微笑む）どうぞ。ごゆっくり。",
    "こちらが映画です（字幕版）。どうぞ。",
    "*smiles. warmly* Hello there. How are you? Fine.",
    "**Hello.** How are you? Good.",
    "Sure, that costs 3.5 dollars. Anything else? No.",
    "Well... I think so. Yes.",
    "いらっしゃいませ。<笑>」どうぞ。",
    "はい。\nみのり：どうぞ。ごゆっくり。",
    "はい。\n旅人1：ありがとう。",
    "Hello! Dr. Kato: hi.",
    "みのり：「はい、どうぞ。」",
    'He said "hello." Then left. Bye.',
    "いらっしゃいませ、本日はお越しいただき誠にありがとうございます、ごゆっくりお過ごしくださいませ、"
    "季節のケーキもございますのでぜひどうぞ。はい。",
    "こんにちは。今日は、とても良いお天気ですね、お散歩日和で、公園の桜も満開で、"
    "たくさんの人がお花見を楽しんでいらっしゃいますよ、ぜひ。はい。",
    "assistant\nはい、どうぞ。ごゆっくり。",
    "はい。# 見出し\nどうぞ。",
    "はい！？ええ。そう。",
    "はい。」どうぞ。そう。",
    # Found by random pieces: a label or this NPC's prefix half written after a line break or a
    # closing bracket changes the text after it (and the sentence's length at the char limit).
    "』'assistant\nみのり：]）assistant\n？assistant\n- はい",
    "]？- assistant\n 旅人1：みのり： Howどうぞ",
    "」[motion:bow]？assistant\nUser:]3.5>*Dr. ",
    ".＜笑＞()[happy]Dr. Kato:[motion:bow]\n**[はいHello",
    'どうぞ（Dr. Kato:]“")User:',
)


def _examples() -> list[str]:
    lines = SHARED_EXAMPLES.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["raw"] for line in lines if line.strip()]


def _stream(raw: str, chunk: int, *, max_sentences: int, max_chars: int) -> tuple[list[str], Progress]:
    """Read `raw` in chunks as the responder does; every announcement of final sentences, and the end."""
    options = {"own_names": OWN, "other_speakers": OTHERS}
    seen: list[str] = []
    so_far = ""
    for start in range(0, len(raw), chunk):
        so_far += raw[start : start + chunk]
        if has_enough(so_far, max_sentences=max_sentences, **options):
            break
        progress = final_sentences(so_far, max_sentences=max_sentences, max_chars=max_chars, **options)
        # What is final may look less final for a moment ("はい。\nみのり：" until the next sentence
        # begins), never different.
        shorter = min(len(seen), len(progress.final))
        assert list(progress.final[:shorter]) == seen[:shorter], f"changed at {so_far!r}"
        seen = max(seen, list(progress.final), key=len)
        if progress.complete:
            break
    end = final_sentences(so_far, max_sentences=max_sentences, max_chars=max_chars, ended=True, **options)
    return seen, end


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("raw", _examples())
def test_final_sentences_of_the_shared_examples_join_to_the_whole_line_cleaning(raw: str, chunk: int) -> None:
    expected = clean(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=2, max_chars=90)
    seen, end = _stream(raw, chunk, max_sentences=2, max_chars=90)
    assert list(end.final[: len(seen)]) == seen
    assert "".join(end.final) == expected.text
    assert len(end.final) == len(units(expected.text)[0])


@pytest.mark.parametrize(("max_sentences", "max_chars"), [(1, 90), (2, 90), (3, 90), (2, 30), (3, 24), (2, 12)])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("raw", HARD_RAWS)
def test_no_chunking_changes_a_sentence_once_it_is_final(
    raw: str, chunk: int, max_sentences: int, max_chars: int
) -> None:
    expected = clean(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=max_sentences, max_chars=max_chars)
    seen, end = _stream(raw, chunk, max_sentences=max_sentences, max_chars=max_chars)
    assert list(end.final[: len(seen)]) == seen
    assert "".join(end.final) == expected.text


# Pieces that open, close, cut or remove: random replies made of them find the corner cases.
ATOMS = (
    "はい",
    "どうぞ",
    "ですね",
    "。",
    "！",
    "？",
    "、",
    "「",
    "」",
    "『",
    "』",
    "（",
    "）",
    "(",
    ")",
    "[happy]",
    "[motion:bow]",
    "[",
    "]",
    "<",
    ">",
    "＜笑＞",
    "*",
    "**",
    " ",
    "\n",
    "みのり：",
    "旅人1：",
    "User:",
    "っ",
    "て",
    "と",
    "Hello",
    ".",
    " How",
    "3.5",
    "…",
    "<|im_end|>",
    "# 見出し\n",
    "- ",
    '"',
    "'",
    "”",
    "“",
    "Dr. Kato:",
    "Dr.",
    "assistant\n",
)


@pytest.mark.parametrize("seed", range(4))
def test_random_replies_from_tricky_pieces_never_change_a_final_sentence(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        raw = "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 14)))
        max_sentences, max_chars = rng.choice([(1, 90), (2, 90), (3, 24), (2, 12)])
        expected = clean(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=max_sentences, max_chars=max_chars)
        seen, end = _stream(raw, rng.choice(CHUNKS), max_sentences=max_sentences, max_chars=max_chars)
        assert list(end.final[: len(seen)]) == seen, raw
        assert "".join(end.final) == expected.text, raw


def test_the_first_sentence_is_final_once_the_second_has_begun() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 2, "max_chars": 90}
    assert final_sentences("[happy]いらっしゃいませ。", **options).final == ()
    progress = final_sentences("[happy]いらっしゃいませ。今", **options)
    assert (progress.final, progress.emotion, progress.complete) == (("いらっしゃいませ。",), "happy", False)
    assert final_sentences("[happy]いらっしゃいませ。今日も。ど", **options).complete


def test_a_sentence_after_a_space_keeps_it_so_the_parts_join_to_the_line() -> None:
    options = {"own_names": (), "other_speakers": (), "max_sentences": 2, "max_chars": 90}
    progress = final_sentences("Hello there. How are you? I", **options)
    assert progress.final == ("Hello there.", " How are you?") and progress.complete


def test_a_line_in_quotes_waits_for_its_closing_quote() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 2, "max_chars": 90}
    assert final_sentences("「いらっしゃいませ。ごゆっ", **options).final == ()
    assert final_sentences("「いらっしゃいませ。ごゆっくり。」", **options, ended=True).final == (
        "いらっしゃいませ。",
        "ごゆっくり。",
    )


def test_a_label_of_a_speaker_whose_name_holds_a_sentence_end_holds_back_what_it_could_cut() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 3, "max_chars": 90}
    # "Dr." looks like a sentence of its own until it is clear whether "Dr. Kato:" follows.
    assert final_sentences("Hello! Dr. K", **options).final == ()
    assert final_sentences("Hello! Dr. Kato", **options).final == ()
    assert final_sentences("Hello! Dr. Kato:", **options) == Progress(("Hello!",), "neutral", complete=True)
    assert final_sentences("Hello! Dr. Kato is", **options).final == ("Hello!", " Dr.")


def test_a_half_written_tag_holds_back_what_it_could_swallow() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 3, "max_chars": 90}
    assert final_sentences("はい。[motion: bow。] ど", **options).final == ("はい。",)
    assert final_sentences("はい。どうぞ[hap。ええ", **options).final == ("はい。",)


def test_an_over_long_first_sentence_is_final_at_its_cut() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 2, "max_chars": 20}
    raw = "いらっしゃいませ、本日はお越しいただき誠にありがとうございます"
    progress = final_sentences(raw, **options)
    assert progress.complete
    assert progress.final == (clean(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=2, max_chars=20).text,)


def test_the_spoken_sentences_before_an_inline_memory_block_are_final_the_block_never() -> None:
    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": 2, "max_chars": 90}
    spoken, _ = split_inline_memory("おかえり！今日はどうだった？\n<memory>\n- ユーザーは猫")
    assert final_sentences(spoken, **options).final == ("おかえり！",)
    assert final_sentences(spoken, **options, ended=True).final == ("おかえり！", "今日はどうだった？")
