"""The memory checks (memory.md "The checks"): one rule at a time, both sides of each boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge.memory.checks import MemoryRules, check_candidates, comparable, copies_run
from bridge.memory.extractor import EXTRACTION_INSTRUCTIONS, parse_memories
from bridge.settings import Settings

# Real model output with the memories that must survive (a copy of the project's examples file).
EXAMPLES = Path(__file__).with_name("extractions.jsonl")

RULES = MemoryRules.from_settings(Settings(), instructions=EXTRACTION_INSTRUCTIONS)


def rule_of(candidate: object, *, kept: tuple[str, ...] = (), rules: MemoryRules = RULES) -> str | None:
    accepted, rejected = check_candidates([candidate], kept=kept, rules=rules)
    if accepted:
        return None
    return rejected[0].rule


def load_examples() -> list[dict[str, object]]:
    return [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("case", load_examples(), ids=lambda case: str(case["note"])[:40])
def test_recorded_extraction_keeps_exactly_its_kept_list(case: dict[str, object]) -> None:
    candidates = parse_memories(str(case["raw"]))
    assert candidates is not None
    accepted, _ = check_candidates(candidates, kept=[], rules=RULES)
    assert accepted == case["kept"]


def test_a_plain_fact_is_kept_trimmed_not_normalised() -> None:
    accepted, rejected = check_candidates(["  ユーザーはＳＦ映画が好き \n"], kept=[], rules=RULES)
    assert accepted == ["ユーザーはＳＦ映画が好き"]
    assert rejected == []


@pytest.mark.parametrize(
    "candidate", [None, 3, 1.5, True, ["ユーザーは紅茶が好き"], {"text": "ユーザーは紅茶が好き"}]
)
def test_a_candidate_that_is_not_a_string_is_rejected(candidate: object) -> None:
    assert rule_of(candidate) == "not_a_string"


@pytest.mark.parametrize(
    ("candidate", "rule"),
    [
        ("紅茶が好きなユーザー", "subject"),
        ("お客様は紅茶が好き", "subject"),
        ("ﾕｰｻﾞｰは紅茶が好き", None),  # half-width katakana is the same word after NFKC
        ("ユーザーは紅茶が好き", None),
    ],
)
def test_a_memory_starts_with_the_subject_word(candidate: str, rule: str | None) -> None:
    assert rule_of(candidate) == rule


def test_the_subject_word_is_configurable() -> None:
    rules = MemoryRules(subject="User", instructions="")
    assert rule_of("User likes green tea", rules=rules) is None
    assert rule_of("ユーザーは紅茶が好き", rules=rules) == "subject"


@pytest.mark.parametrize(
    ("candidate", "rule"),
    [
        ("ユーザー猫", "length"),  # 5
        ("ユーザーは猫", None),  # 6
        ("ユーザーは" + "あ" * 75, None),  # 80
        ("ユーザーは" + "あ" * 76, "length"),  # 81
        ("  ユーザー猫  ", "length"),  # trimmed before counting
        ("ユーザーは" + "ａ" * 75, None),  # full-width letters count once each after NFKC
    ],
)
def test_length_is_six_to_eighty_characters_after_trim_and_nfkc(candidate: str, rule: str | None) -> None:
    assert rule_of(candidate) == rule


def test_nfkc_can_lengthen_a_candidate_past_the_limit() -> None:
    # "㍻" is one character but "平成" after NFKC: lengths are counted on the normalised text.
    assert rule_of("ユーザーは" + "あ" * 74 + "㍻") == "length"
    assert rule_of("ユーザーは" + "あ" * 74 + "平") is None


@pytest.mark.parametrize(
    "candidate", ["ユーザーは紅茶が\n好き", "ユーザーは紅茶が\r好き", "ユーザーは紅茶が\u2028好き"]
)
def test_a_line_break_inside_is_rejected(candidate: str) -> None:
    assert rule_of(candidate) == "line_break"


def test_a_line_break_at_the_ends_is_trimmed_away() -> None:
    assert rule_of("\nユーザーは紅茶が好き\n") is None


@pytest.mark.parametrize(
    "candidate",
    [
        "ユーザーは<b>紅茶</b>が好き",
        "ユーザーは{item}が好き",
        "ユーザーは[紅茶]が好き",
        "ユーザーは**紅茶**が好き",
        "ユーザーは#紅茶が好き",
        "ユーザーは`紅茶`が好き",
        "ユーザーは＜紅茶＞が好き",  # full-width brackets are markup after NFKC
        "ユーザーは https://example.com が好き",
        "ユーザーはwww.example.comをよく見る",
    ],
)
def test_markup_is_rejected(candidate: str) -> None:
    assert rule_of(candidate) == "markup"


@pytest.mark.parametrize(
    ("candidate", "rule"),
    [
        ("ユーザーは紅茶が好き。コーヒーは苦手", "one_sentence"),
        ("ユーザーは紅茶が好き！毎日飲む", "one_sentence"),
        ("ユーザーは紅茶が好き?毎日飲む", "one_sentence"),
        ("ユーザーは紅茶が好き。", None),
        ("ユーザーは紅茶が大好き！！", None),
        ("ユーザーは紅茶が好き…", None),
        ("ユーザーはPython 3.11を使っている", None),  # a decimal point is not a sentence end
    ],
)
def test_a_memory_is_one_sentence(candidate: str, rule: str | None) -> None:
    assert rule_of(candidate) == rule


@pytest.mark.parametrize(
    "candidate",
    [
        "ユーザーは仕事で疲れている",
        "ユーザーは眠いと言った",
        "ユーザーはお腹が空いている",
        "ユーザーは今日は機嫌がいい",
    ],
)
def test_a_mood_of_the_day_is_rejected(candidate: str) -> None:
    assert rule_of(candidate) == "mood"


@pytest.mark.parametrize(
    "candidate",
    [
        "ユーザーは好みの言及はない",
        "ユーザーは何を頼むか決めていない",
        "ユーザーは特にないと言った",
        "ユーザーは行き先が分からない",
    ],
)
def test_a_non_fact_is_rejected(candidate: str) -> None:
    assert rule_of(candidate) == "non_fact"


@pytest.mark.parametrize(
    "candidate",
    ["ユーザーはラテを注文した", "ユーザーはケーキを頼んでいる", "ユーザーはオーダーを迷っている"],
)
def test_the_order_of_the_moment_is_rejected(candidate: str) -> None:
    assert rule_of(candidate) == "order"


def test_word_lists_come_from_settings() -> None:
    settings = Settings(memory_mood_words="ごきげん", memory_non_fact_words="", memory_order_words="")
    rules = MemoryRules.from_settings(settings, instructions="")
    assert rule_of("ユーザーは今日もごきげん", rules=rules) == "mood"
    assert rule_of("ユーザーは仕事で疲れている", rules=rules) is None


def test_a_stored_duplicate_is_rejected() -> None:
    assert rule_of("ユーザーは紅茶が好き", kept=("ユーザーは紅茶が好き",)) == "duplicate"


def test_full_width_and_half_width_are_the_same_memory() -> None:
    assert rule_of("ユーザーはＳＦ映画が好き", kept=("ユーザーはSF映画が好き",)) == "duplicate"
    assert rule_of("ユーザーはSF映画が好き", kept=("ユーザーはＳＦ映画が好き",)) == "duplicate"


def test_spaces_and_punctuation_do_not_make_a_new_memory() -> None:
    assert rule_of("ユーザーは、 紅茶が 好き。", kept=("ユーザーは紅茶が好き",)) == "duplicate"


def test_a_candidate_contained_in_a_stored_memory_is_rejected() -> None:
    assert rule_of("ユーザーは紅茶が好き", kept=("ユーザーは紅茶が好きで毎朝飲む",)) == "duplicate"


def test_a_candidate_containing_a_stored_memory_is_rejected() -> None:
    assert rule_of("ユーザーは紅茶が好きで毎朝飲む", kept=("ユーザーは紅茶が好き",)) == "duplicate"


def test_an_unrelated_memory_is_not_a_duplicate() -> None:
    assert rule_of("ユーザーは緑茶も好き", kept=("ユーザーは紅茶が好き",)) is None


def test_duplicates_within_one_answer_keep_the_first() -> None:
    accepted, rejected = check_candidates(
        ["ユーザーは紅茶が好き", "ユーザーは紅茶が好きで毎朝飲む", "ユーザーは紅茶が好き"],
        kept=[],
        rules=RULES,
    )
    assert accepted == ["ユーザーは紅茶が好き"]
    assert [r.rule for r in rejected] == ["duplicate", "duplicate"]


def test_a_seven_character_copy_of_the_prompt_passes_and_eight_is_rejected() -> None:
    rules = MemoryRules(instructions="説明文: あいうえおかきくけこ で終わる")
    assert rule_of("ユーザーはあいうえおかきが好き", rules=rules) is None  # あいうえおかき: 7
    assert rule_of("ユーザーはあいうえおかきくが好き", rules=rules) == "prompt_copy"  # 8


def test_prompt_copy_compares_normalised_text() -> None:
    rules = MemoryRules(instructions="ＡＢＣＤ、ＥＦＧＨ")
    assert rule_of("ユーザーはabcd efghが好き", rules=rules) == "prompt_copy"


def test_copying_the_real_extraction_prompt_is_rejected() -> None:
    assert rule_of("ユーザーは好みや苦手なものを話した") == "prompt_copy"


def test_copies_run_boundary() -> None:
    assert not copies_run("xxabcdefgxx", "abcdefg", run_chars=8)
    assert copies_run("xxabcdefghxx", "abcdefgh", run_chars=8)


def test_at_most_three_are_kept_in_the_order_written() -> None:
    candidates: list[object] = [
        "ユーザーは疲れている",
        "ユーザーは紅茶が好き",
        "ユーザーは猫を飼っている",
        "ユーザーは北海道の出身",
        "ユーザーは毎週ジムに通う",
    ]
    accepted, rejected = check_candidates(candidates, kept=[], rules=RULES)
    assert accepted == ["ユーザーは紅茶が好き", "ユーザーは猫を飼っている", "ユーザーは北海道の出身"]
    assert [(r.text, r.rule) for r in rejected] == [
        ("ユーザーは疲れている", "mood"),
        ("ユーザーは毎週ジムに通う", "over_limit"),
    ]


def test_comparable_form_drops_width_spaces_punctuation_and_case() -> None:
    assert comparable("ユーザーは、ＳＦ 映画が好き。") == comparable("ユーザーはsf映画が好き")
