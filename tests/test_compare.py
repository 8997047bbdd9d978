"""The one comparison form for copies and duplicates (bridge/compare.py), shared by reply and memory checks."""

from __future__ import annotations

import unicodedata

from bridge.compare import comparable, copies_run


def test_comparable_drops_every_space_and_punctuation_mark_and_keeps_the_rest() -> None:
    text = "".join(chr(code) for code in range(0x20, 0x3100)) + "ＳＦ\u3000映画、好き！"
    expected = "".join(
        char
        for char in unicodedata.normalize("NFKC", text).casefold()
        if not char.isspace() and not unicodedata.category(char).startswith("P")
    )
    # Twice: the second run reads the translate table the first one filled.
    assert comparable(text) == expected
    assert comparable(text) == expected
    assert comparable("ユーザーは、ＳＦ 映画が好き。") == "ユーザーはsf映画が好き"


def test_a_run_copied_from_the_source_is_found_in_any_width_spacing_or_case() -> None:
    source = "短く、自然な話し言葉で答えてください。"
    assert copies_run("はい。短く自然な 話し言葉で答えますね", source, run_chars=8)
    assert not copies_run("はい、短くお答えしますね。", source, run_chars=8)
    assert copies_run("ANSWER IN ENGLISH", "Answer in English.", run_chars=12)
    assert not copies_run("short", "short", run_chars=8)  # shorter than a run: never a copy
