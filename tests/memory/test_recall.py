"""Recall (memory.md "Recall"): the newest few always, then what the line is about, by BM25 over bigrams."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from bridge import logs
from bridge.llm.gate import LLMGate
from bridge.llm.ollama import OllamaBackend
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.models import Memory
from bridge.memory.recall import Recalled, recall, recall_fields, scores, terms
from bridge.memory.store import MemoryStore
from bridge.npc.characters import Character, Roster
from bridge.settings import Settings

EXAMPLES = Path(__file__).with_name("recall.jsonl")  # the shared examples' recall.jsonl
JST = timezone(timedelta(hours=9))
DAY = datetime(2026, 6, 1, 20, 0, tzinfo=JST)
SUBJECT = "ユーザー"


def _cases() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]


def memories(*texts: str) -> list[Memory]:
    """One memory a day, oldest first."""
    return [Memory(text=text, heard_at=DAY + timedelta(days=n)) for n, text in enumerate(texts)]


def choose(items: list[Memory], *query: str, limit: int = 10, recent: int = 3, language: Any = "ja") -> list[Recalled]:
    return recall(items, list(query), limit=limit, recent=recent, subject=SUBJECT, language=language)


FILLER = [f"ユーザーは{thing}が好き" for thing in "海花夏冬猫犬山川雨雪空星"]


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case["id"])
def test_every_public_case_recalls_its_memory_and_the_newest_three(case: dict[str, Any]) -> None:
    items = [Memory.model_validate(m) for m in case["memories"]]
    recalled = choose(items, case["line"])
    texts = [item.text for item in recalled]
    assert len(recalled) == 10
    assert case["expect"] in texts
    assert set(case["newest"]) <= set(texts)
    (expected,) = [item for item in recalled if item.text == case["expect"]]
    assert expected.why == "relevant" and expected.score > 0
    # Newest-10 would have missed it: the example is about an old memory.
    assert case["expect"] not in [m.text for m in items[-10:]]


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case["id"])
def test_the_expected_memory_scores_highest_of_all(case: dict[str, Any]) -> None:
    texts = [m["text"] for m in case["memories"]]
    scored = scores(texts, [case["line"]], subject=SUBJECT)
    best = max(scored, key=lambda number: scored[number][0])
    assert texts[best] == case["expect"]


def test_recalled_memories_come_oldest_first_with_their_dates() -> None:
    items = memories(*FILLER, "ユーザーは盆栽を育てている", *FILLER[:5])
    items[0] = Memory(text="ユーザーは盆栽の本を持っている", heard_at=DAY - timedelta(days=30))
    recalled = choose(items, "盆栽の枝がのびすぎちゃって", limit=5, recent=2)
    assert [item.heard_at for item in recalled] == sorted(item.heard_at for item in recalled)
    assert recalled[0].text == "ユーザーは盆栽の本を持っている"


def test_the_newest_are_always_recalled_even_when_others_score_higher() -> None:
    items = memories("ユーザーは盆栽を育てている", "ユーザーは盆栽の鉢を集めている", *FILLER)
    recalled = choose(items, "盆栽", limit=4, recent=2)
    assert [(item.text, item.why) for item in recalled] == [
        ("ユーザーは盆栽を育てている", "relevant"),
        ("ユーザーは盆栽の鉢を集めている", "relevant"),
        (FILLER[-2], "recent"),
        (FILLER[-1], "recent"),
    ]


def test_a_memory_sharing_nothing_with_the_line_is_never_relevant_free_places_go_to_the_next_newest() -> None:
    items = memories("ユーザーは盆栽を育てている", *FILLER)
    recalled = choose(items, "盆栽を見に行きたい", limit=6, recent=3)
    assert [item.why for item in recalled] == ["relevant", "recent", "recent", "recent", "recent", "recent"]
    assert [item.text for item in recalled[1:]] == FILLER[-5:]
    assert all(item.score == 0 for item in recalled[1:])
    nothing = choose(items, "こんにちは", limit=6, recent=3)
    assert [item.text for item in nothing] == FILLER[-6:]
    assert {item.why for item in nothing} == {"recent"}


def test_equal_scores_go_to_the_newer_memory() -> None:
    items = memories("ユーザーは将棋が好き", "ユーザーは将棋が好き。", *FILLER)
    recalled = choose(items, "将棋", limit=4, recent=3)
    assert "ユーザーは将棋が好き。" in [item.text for item in recalled if item.why == "relevant"]
    assert "ユーザーは将棋が好き" not in [item.text for item in recalled]


def test_the_subject_word_never_counts() -> None:
    assert terms("ユーザーは紅茶が好き", SUBJECT) == ("は紅", "紅茶", "茶が", "が好", "好き")
    items = memories("ユーザーは盆栽を育てている", *FILLER)
    recalled = choose(items, "ユーザーって呼ばないでよ", limit=4, recent=3)
    assert all(item.why == "recent" for item in recalled)


def test_bigrams_found_in_many_memories_count_little_or_nothing() -> None:
    # 好き is in every filler; 盆栽 in one memory: the line's 好き must not outweigh its 盆栽.
    items = memories("ユーザーは盆栽を育てている", *FILLER, "ユーザーは紅茶が好き")
    scored = scores([m.text for m in items], ["盆栽が好き"], subject=SUBJECT)
    assert max(scored, key=lambda number: scored[number][0]) == 0
    assert set(scored) == {0}  # が好 / 好き are in more than half of the memories: weight 0
    assert scored[0][1] == ("盆栽",)


def test_normalisation_width_case_spaces_and_punctuation() -> None:
    assert terms("ユーザーはＳＦ映画、好き！", SUBJECT) == terms("ユーザーはsf映画 好き", SUBJECT)
    assert terms("ユーザーはsf映画 好き", SUBJECT) == ("はs", "sf", "f映", "映画", "好き")  # no term spans a space
    items = memories("ユーザーはSF映画が好き", *FILLER)
    recalled = choose(items, "ｓｆ、見た？", limit=4, recent=3)
    assert recalled[0].text == "ユーザーはSF映画が好き" and recalled[0].why == "relevant"


def test_the_previous_line_of_the_session_is_part_of_the_query() -> None:
    items = memories("ユーザーは盆栽を育てている", *FILLER)
    assert all(item.why == "recent" for item in choose(items, "枝が伸びすぎちゃった", limit=4))
    recalled = choose(items, "枝が伸びすぎちゃった", "盆栽の話なんだけど", limit=4)
    assert recalled[0].text == "ユーザーは盆栽を育てている" and recalled[0].why == "relevant"


def test_english_characters_use_words() -> None:
    assert terms("User has two cats, and likes the sea.", "User", "en") == (
        "has",
        "two",
        "cat",
        "and",
        "like",
        "the",
        "sea",
    )
    items = [
        Memory(text=text, heard_at=DAY + timedelta(days=n))
        for n, text in enumerate(
            [
                "User has a cat named Mochi",
                "User plays the cello",
                *[f"User likes the colour {colour}" for colour in ("red", "blue", "green", "pink", "grey")],
            ]
        )
    ]
    recalled = recall(items, ["My cats knocked over the vase"], limit=4, recent=3, subject="User", language="en")
    assert recalled[0].text == "User has a cat named Mochi" and recalled[0].matched == ("cat",)
    # Bigrams would find "ce" of "cello" in "place"; words do not.
    near = recall(items, ["nice place"], limit=4, recent=3, subject="User", language="en")
    assert all(item.why == "recent" for item in near)


def test_all_memories_fit_no_memories_and_recall_off() -> None:
    items = memories("ユーザーは盆栽を育てている", "ユーザーは海が好き")
    assert [item.text for item in choose(items, "盆栽")] == [m.text for m in items]
    assert choose([], "盆栽") == []
    assert choose(items, "盆栽", limit=0) == []


def test_more_recent_than_the_limit_is_clamped_to_the_limit() -> None:
    items = memories("ユーザーは盆栽を育てている", *FILLER)
    recalled = choose(items, "盆栽", limit=2, recent=5)
    assert [item.text for item in recalled] == FILLER[-2:]
    assert choose(items, "盆栽", limit=2, recent=0)[0].why == "relevant"


def test_the_reply_log_fields_count_each_reason_and_hold_the_texts_under_a_content_key() -> None:
    recalled = choose(memories("ユーザーは盆栽を育てている", *FILLER), "盆栽", limit=4, recent=3)
    fields = recall_fields(recalled)
    assert (fields["recalled_recent"], fields["recalled_relevant"]) == (3, 1)
    assert fields["recalled"] == [item.text for item in recalled]
    assert "recalled" in logs.CONTENT_KEYS  # so the log filter drops the texts unless content logging is on


async def test_the_keeper_recalls_by_words_for_an_english_character_and_dates_in_the_zone(tmp_path: Path) -> None:
    shop = Character.model_validate(
        {"id": "book-shop", "name": "Ann", "persona": "A bookseller.", "talk": "worker", "speech": {"language": "en"}}
    )
    store = MemoryStore(tmp_path, limit=60)
    texts = ["User has a cat named Mochi", *[f"User likes the colour {c}" for c in ("red", "blue", "green", "pink")]]
    for n, text in enumerate(texts):
        await store.add_memories("book-shop", [text], datetime(2026, 9, 1 + n, 23, 30, tzinfo=UTC), "extraction")
    keeper = MemoryKeeper(
        store=store,
        backend=OllamaBackend("http://127.0.0.1:9"),
        gate=LLMGate(1),
        roster=Roster({"book-shop": shop}),
        settings=Settings(
            memory_dir=tmp_path, memory_subject="User", memory_recall=2, memory_recall_recent=1, timezone="Asia/Tokyo"
        ),
        shared=None,
    )
    recalled = await keeper.recall("book-shop", query="The cats are asleep", previous="Hello")
    assert [(item.text, item.why) for item in recalled] == [
        ("User has a cat named Mochi", "relevant"),
        ("User likes the colour pink", "recent"),
    ]
    assert recalled[0].heard_at is not None and (recalled[0].heard_at.month, recalled[0].heard_at.day) == (9, 2)
