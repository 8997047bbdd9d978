"""Said again (memory.md "Said again"): equal → refreshed, containing → replaces, contained → duplicate."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from structlog.testing import capture_logs

from bridge.llm.ollama import OllamaBackend
from bridge.logs import CONTENT_KEYS
from bridge.memory.checks import Kept, MemoryRules, apply_kept, decide
from bridge.memory.extractor import EXTRACTION_INSTRUCTIONS
from bridge.memory.models import Memory
from bridge.memory.store import MemoryStore
from bridge.settings import Settings
from tests.fakes.llm_servers import FakeOllama
from tests.memory.helpers import FAST_RETRY, make_keeper, read_file, recalled_lines

RULES = MemoryRules.from_settings(Settings(), instructions=EXTRACTION_INSTRUCTIONS)
JST = timezone(timedelta(hours=9))
THEN = datetime(2026, 9, 29, 21, 0, tzinfo=JST)
NOW = datetime(2026, 11, 3, 20, 0, tzinfo=JST)
CAMP = "ユーザーは来週の土曜にキャンプに行く"
TEA = "ユーザーは紅茶が好き"
CAT = "ユーザーは猫を飼っている"


def test_a_candidate_equal_to_a_stored_memory_refreshes_it() -> None:
    kept, rejected = decide(["ユーザーは、来週の土曜にキャンプに行く。"], stored=[TEA, CAMP], rules=RULES)
    assert rejected == []
    assert kept == [Kept("ユーザーは、来週の土曜にキャンプに行く。", refreshes=CAMP)]


def test_a_candidate_containing_a_stored_memory_replaces_it() -> None:
    longer = "ユーザーは紅茶が好きで毎朝ミルクティーを飲む"
    kept, rejected = decide([longer], stored=[TEA, CAT], rules=RULES)
    assert rejected == [] and kept == [Kept(longer, replaces=(TEA,))]


def test_a_candidate_contained_in_a_stored_memory_stays_a_duplicate() -> None:
    kept, rejected = decide([TEA], stored=["ユーザーは紅茶が好きで毎朝飲む"], rules=RULES)
    assert kept == [] and [r.rule for r in rejected] == ["duplicate"]


def test_equal_wins_over_contained_in_another_stored_memory() -> None:
    kept, _ = decide([TEA], stored=["ユーザーは紅茶が好きで毎朝飲む", TEA], rules=RULES)
    assert kept == [Kept(TEA, refreshes=TEA)]


def test_a_refresh_counts_towards_the_three_kept_and_still_passes_the_other_checks() -> None:
    candidates: list[object] = [TEA, CAT, "ユーザーは将棋が得意", "ユーザーは北海道の出身"]
    kept, rejected = decide(candidates, stored=[TEA], rules=RULES)
    assert [item.text for item in kept] == [TEA, CAT, "ユーザーは将棋が得意"]
    assert [r.rule for r in rejected] == ["over_limit"]
    # A mood is a mood even when a stored memory says it (an old file, a changed word list).
    moody = "ユーザーは今日は疲れている"
    assert decide([moody], stored=[moody], rules=RULES)[1][0].rule == "mood"


def test_within_one_answer_a_repeat_is_still_a_duplicate() -> None:
    kept, rejected = decide([TEA, TEA, "ユーザーは紅茶が好きで毎朝飲む"], stored=[TEA], rules=RULES)
    assert kept == [Kept(TEA, refreshes=TEA)]
    assert [r.rule for r in rejected] == ["duplicate", "duplicate"]


def test_without_said_again_equal_and_containing_are_duplicates() -> None:
    kept, rejected = decide([TEA, "ユーザーは紅茶が好きで毎朝飲む"], stored=[TEA], rules=RULES, said_again=False)
    assert kept == [] and [r.rule for r in rejected] == ["duplicate", "duplicate"]


def test_applying_a_refresh_moves_the_memory_to_the_newest_place_with_the_new_date() -> None:
    stored = [
        Memory(text=CAMP, heard_at=THEN, source="inline"),
        Memory(text=TEA, heard_at=THEN + timedelta(days=1)),
    ]
    again = Kept("ユーザーは来週の土曜にキャンプに行く。", refreshes=CAMP)
    after = apply_kept(stored, [again], heard_at=NOW, source="extraction")
    assert [(m.text, m.heard_at, m.source) for m in after] == [
        (TEA, THEN + timedelta(days=1), "extraction"),
        (CAMP, NOW, "inline"),  # the stored text and source stay
    ]
    assert '"heard_at": "2026-11-03T20:00:00+09:00"' in after[-1].json_line


def test_applying_a_replacement_removes_the_part_and_adds_the_whole() -> None:
    longer = "ユーザーは紅茶が好きで毎朝ミルクティーを飲む"
    stored = [Memory(text=TEA, heard_at=THEN), Memory(text=CAT, heard_at=THEN)]
    after = apply_kept(stored, [Kept(longer, replaces=(TEA,)), Kept("ユーザーは将棋が得意")], heard_at=NOW, source="x")
    assert [m.text for m in after] == [CAT, longer, "ユーザーは将棋が得意"]
    assert after[1].heard_at == NOW


async def test_the_limit_then_forgets_what_was_heard_longest_ago(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=3)
    await store.add_memories("cafe-minori", [CAMP, TEA, CAT], THEN, "extraction")
    await store.record_extraction("cafe-minori", taken=0, kept=[Kept(CAMP, refreshes=CAMP)], heard_at=NOW)
    await store.record_extraction("cafe-minori", taken=0, texts=["ユーザーは将棋が得意"], heard_at=NOW)
    assert [m.text for m in (await store.load("cafe-minori")).memories] == [CAT, CAMP, "ユーザーは将棋が得意"]


async def test_the_keeper_refreshes_and_replaces_with_their_own_log_lines(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", [CAMP, TEA, CAT], THEN, "extraction")
    async with FakeOllama() as ollama:
        backend = OllamaBackend(ollama.url, retry=FAST_RETRY)
        keeper = make_keeper(tmp_path, backend, log_content=True)
        with capture_logs() as logs:
            kept = await keeper.save_inline("cafe-minori", [CAMP, "ユーザーは猫を飼っている、名前はモチ"], at=NOW)
        await backend.aclose()
    assert kept == [CAMP, "ユーザーは猫を飼っている、名前はモチ"]
    events = {e["event"]: e for e in logs if e["event"].startswith("memory_")}
    assert events["memory_refreshed"]["text"] == CAMP
    assert events["memory_replaced"]["text"] == "ユーザーは猫を飼っている、名前はモチ"
    assert events["memory_replaced"]["replaced"] == CAT
    assert "memory_kept" not in events and "memory_rejected" not in events
    data = read_file(tmp_path, "cafe-minori")["memories"]
    assert [(m["text"], m["heard_at"]) for m in data] == [
        (TEA, "2026-09-29T21:00:00+09:00"),
        (CAMP, "2026-11-03T20:00:00+09:00"),
        ("ユーザーは猫を飼っている、名前はモチ", "2026-11-03T20:00:00+09:00"),
    ]
    # The next prompt shows the plan with the day it was heard again.
    assert f"- (11/3) {CAMP}" in await recalled_lines(keeper, "cafe-minori", "キャンプ楽しみ")


async def test_the_said_again_lines_hold_texts_only_under_keys_the_content_gate_drops(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", [TEA, CAT], THEN, "extraction")
    async with FakeOllama() as ollama:
        backend = OllamaBackend(ollama.url, retry=FAST_RETRY)
        keeper = make_keeper(tmp_path, backend)
        with capture_logs() as logs:
            await keeper.save_inline("cafe-minori", [TEA, "ユーザーは猫を飼っている、名前はモチ"], at=NOW)
        await backend.aclose()
    lines = [e for e in logs if e["event"] in ("memory_refreshed", "memory_replaced")]
    texts = {TEA, CAT, "ユーザーは猫を飼っている、名前はモチ"}
    carried = {key for line in lines for key, value in line.items() if value in texts}
    assert len(lines) == 2 and carried and carried <= CONTENT_KEYS
