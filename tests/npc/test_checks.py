"""A cleaned reply is checked before it is spoken (replies.md "Checks, regeneration, fallback")."""

from __future__ import annotations

import pytest

from bridge.npc.checks import check_reply, in_language, letter_counts, regeneration_hint

BANNED = ("殺人", "Damn")

JAPANESE = [
    # (text, last line, failed rule or None)
    ("紅茶ですね、すぐにお持ちしますね。", None, None),
    ("", None, "empty"),
    ("   \u3000\n", None, "empty"),
    ("それは殺人事件の映画ですね。", None, "banned_word"),
    ("ＤＡＭＮ、困りましたね。", None, "banned_word"),  # full width, upper case: NFKC + case folding
    ("damn、困りましたね。", None, "banned_word"),
    ("いらっしゃいませ。", "いらっしゃいませ。", "repeat"),
    ("いらっしゃいませ。", " いらっしゃいませ。 ", "repeat"),
    ("いらっしゃいませ！", "いらっしゃいませ。", None),
    ("いらっしゃいませ。", None, None),
    ("Welcome to our cafe!", None, "language"),
    ("Coffeeがおすすめですよ。", None, None),  # 8 kana of 14 letters
    ("OK、Coffeeですね。", None, "language"),  # 3 kana of 11 letters
    ("Coffee and cake、ですね。", None, "language"),
    ("안녕하세요 どうも", None, "language"),  # Hangul letters count against Japanese
    ("……。", None, "language"),  # no letters at all
    ("１２３０円です。", None, None),  # digits are not letters
    ("ｺｰﾋｰです。", None, None),  # half-width katakana is kana after NFKC
    ("々", None, None),
]


@pytest.mark.parametrize(("text", "last_line", "rule"), JAPANESE)
def test_a_japanese_reply_is_checked(text: str, last_line: str | None, rule: str | None) -> None:
    assert check_reply(text, banned=BANNED, last_line=last_line, language="ja") == rule


ENGLISH = [
    ("Welcome! Take a seat.", None, None),
    ("いらっしゃいませ、Welcome.", None, "language"),
    ("Welcome to 映画館!", None, None),
    ("Welcome! Take a seat.", "welcome!  take a seat.", "repeat"),
]


@pytest.mark.parametrize(("text", "last_line", "rule"), ENGLISH)
def test_an_english_reply_is_checked(text: str, last_line: str | None, rule: str | None) -> None:
    assert check_reply(text, banned=BANNED, last_line=last_line, language="en") == rule


def test_the_first_failing_rule_is_named() -> None:
    assert check_reply("殺人", banned=BANNED, last_line="殺人", language="en") == "banned_word"


def test_empty_banned_words_are_ignored() -> None:
    assert check_reply("はい。", banned=["", "  "], last_line=None, language="ja") is None


def test_letters_ignore_digits_punctuation_and_symbols() -> None:
    assert letter_counts("はい、19時です！☕ OK") == (7, 5, 2)


def test_exactly_half_is_enough() -> None:
    assert in_language("はいOK", "ja")  # 2 of 4
    assert in_language("はいOK", "en")


@pytest.mark.parametrize(
    ("rule", "hint"),
    [
        ("repeat", "前と同じ言い方を避けて、別の言葉で短く答えてください。"),
        ("language", "日本語だけで、短く答えてください。"),
        ("banned_word", "使ってはいけない言葉を避けて、別の言い方で短く答えてください。"),
        ("empty", "セリフだけを、短い一言で答えてください。"),
        ("something_else", "もう一度、短く自然に答えてください。"),
    ],
)
def test_each_rule_has_a_short_japanese_hint(rule: str, hint: str) -> None:
    assert regeneration_hint(rule) == hint


def test_an_english_character_gets_an_english_hint() -> None:
    assert regeneration_hint("language", language="en") == "Answer briefly, in English only."


INSTRUCTIONS = "あなたは3Dの街にいるキャラクターとして、話しかけてきた相手（お客さん）と会話します。"


def test_reply_reciting_its_instructions_is_an_echo() -> None:
    reply = "あなたは3Dの街にいるキャラクターとして会話します。"
    assert check_reply(reply, banned=(), last_line=None, language="ja", instructions=INSTRUCTIONS) == "echo"


def test_eleven_copied_characters_are_not_an_echo_but_twelve_are() -> None:
    eleven = "話しかけてきた相手お客さ"[:11]
    twelve = "話しかけてきた相手お客さ"
    assert check_reply(eleven + "ですね。", banned=(), last_line=None, language="ja", instructions=INSTRUCTIONS) is None
    rule = check_reply(twelve + "ですね。", banned=(), last_line=None, language="ja", instructions=INSTRUCTIONS)
    assert rule == "echo"


def test_echo_ignores_punctuation_and_width() -> None:
    reply = "あなたは３Ｄの街にいる、キャラクター。"
    assert check_reply(reply, banned=(), last_line=None, language="ja", instructions=INSTRUCTIONS) == "echo"


def test_echo_has_a_regeneration_hint() -> None:
    assert "繰り返さず" in regeneration_hint("echo")
