"""The keeper against a loopback Ollama: the silence timer, retries, start-up, recall, isolation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bridge.llm.gate import LLMGate, Priority
from bridge.llm.ollama import OllamaBackend
from bridge.memory.cli import forget_by_number, show_lines
from bridge.memory.models import Memory, MemoryFile, PendingLine
from bridge.memory.store import MemoryStore, render
from tests.fakes.llm_servers import Answer, Error, FakeOllama
from tests.memory.helpers import FAST_RETRY, eventually, make_keeper, read_file, recalled_lines, running

JST = timezone(timedelta(hours=9))
AT = datetime(2026, 9, 29, 21, 12, 40, tzinfo=JST)
TEA = '{"memories": ["ユーザーは紅茶が好き"]}'


@pytest.fixture
async def ollama() -> AsyncIterator[FakeOllama]:
    server = FakeOllama()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def backend(ollama: FakeOllama) -> AsyncIterator[OllamaBackend]:
    client = OllamaBackend(ollama.url, retry=FAST_RETRY)
    yield client
    await client.aclose()


async def test_after_the_silence_the_conversation_is_extracted_and_stored(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script(TEA)
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange(
            "cafe-minori", player="ここの紅茶がすきなんだよ", npc="紅茶、お好きなんですね。", at=AT
        )
        # The line is on disk before note_exchange returns.
        assert read_file(tmp_path, "cafe-minori")["pending"][0]["player"] == "ここの紅茶がすきなんだよ"
        request = await ollama.wait_for_requests(1)
        await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    assert "ここの紅茶がすきなんだよ" in request.messages[1]["content"]
    assert request.body["format"]["required"] == ["memories"]
    data = read_file(tmp_path, "cafe-minori")
    assert data["memories"] == [
        {"text": "ユーザーは紅茶が好き", "heard_at": "2026-09-29T21:12:40+09:00", "source": "extraction"}
    ]


async def test_more_talk_before_the_silence_postpones_the_extraction(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script(TEA)
    async with running(make_keeper(tmp_path, backend, memory_silence_seconds=0.5)) as keeper:
        await keeper.note_exchange("cafe-minori", player="ここの紅茶がすきなんだよ", npc="どうぞ。", at=AT)
        # A player keeps talking to her, far more often than the silence: nothing may be extracted.
        for _ in range(12):
            await asyncio.sleep(0.1)
            keeper.touch("cafe-minori")
        await keeper.note_exchange("cafe-minori", player="また来るね", npc="お待ちしています。", at=AT)
        assert ollama.requests == []
        request = await ollama.wait_for_requests(1)
        await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    # One extraction over the whole conversation.
    assert "ここの紅茶がすきなんだよ" in request.messages[1]["content"]
    assert "また来るね" in request.messages[1]["content"]
    assert len(ollama.requests) == 1


async def test_a_failing_model_keeps_the_pending_conversation_and_retries(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script(Error(500, "boom"), Error(500, "boom"), TEA)
    with capture_logs() as logs:
        async with running(make_keeper(tmp_path, backend)) as keeper:
            await keeper.note_exchange("cafe-minori", player="ここの紅茶がすきなんだよ", npc="はい。", at=AT)
            await (await ollama.wait_for_requests(1)).wait_ended()
            await asyncio.sleep(0.01)
            assert len(read_file(tmp_path, "cafe-minori")["pending"]) == 1
            await ollama.wait_for_requests(3)
            await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    assert [m["text"] for m in read_file(tmp_path, "cafe-minori")["memories"]] == ["ユーザーは紅茶が好き"]
    assert [e["event"] for e in logs].count("memory_extraction_failed") == 2


async def test_an_unreachable_model_keeps_the_pending_conversation(tmp_path: Path) -> None:
    async with FakeOllama() as gone:
        url = gone.url  # a port nobody listens on once the server is closed
    backend = OllamaBackend(url, retry=FAST_RETRY)
    try:
        with capture_logs() as logs:
            async with running(make_keeper(tmp_path, backend)) as keeper:
                await keeper.note_exchange("cafe-minori", player="ここの紅茶がすきなんだよ", npc="はい。", at=AT)
                await eventually(lambda: [e["event"] for e in logs].count("memory_extraction_failed") >= 3)
    finally:
        await backend.aclose()
    assert len(read_file(tmp_path, "cafe-minori")["pending"]) == 1
    assert read_file(tmp_path, "cafe-minori")["memories"] == []


async def test_three_unparseable_answers_clear_the_pending_conversation(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script("ごめんなさい。", "覚えることはありません", '{"memories": [')
    with capture_logs() as logs:
        async with running(make_keeper(tmp_path, backend)) as keeper:
            await keeper.note_exchange("cafe-minori", player="こんにちは", npc="こんにちは。", at=AT)
            await eventually(lambda: any(e["event"] == "memory_pending_dropped" for e in logs))
    assert len(ollama.requests) == 3
    assert read_file(tmp_path, "cafe-minori")["pending"] == []
    assert [e["event"] for e in logs].count("memory_extraction_unparseable") == 2


async def test_an_extraction_with_zero_memories_clears_the_pending_conversation(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script('{"memories": []}')
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange("cafe-minori", player="こんにちは", npc="こんにちは。", at=AT)
        await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    assert len(ollama.requests) == 1
    assert read_file(tmp_path, "cafe-minori")["memories"] == []


async def test_lines_noted_during_an_extraction_are_kept_for_the_next_one(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    # The second answer is slow too, so the line noted during the first extraction is still pending
    # when the test looks, even on a loaded machine.
    ollama.script(
        Answer.text(TEA, first_delay_seconds=0.4),
        Answer.text('{"memories": ["ユーザーは猫を飼っている"]}', first_delay_seconds=1.0),
    )
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
        await ollama.wait_for_requests(1)
        await keeper.note_exchange("cafe-minori", player="うちの猫がね", npc="猫ちゃん！", at=AT)
        await (await ollama.wait_for_requests(1)).wait_ended()
        await eventually(lambda: len(read_file(tmp_path, "cafe-minori")["memories"]) == 1)
        assert [p["player"] for p in read_file(tmp_path, "cafe-minori")["pending"]] == ["うちの猫がね"]
        second = await ollama.wait_for_requests(2)
        await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    assert "紅茶がすき" not in second.messages[1]["content"]
    assert [m["text"] for m in read_file(tmp_path, "cafe-minori")["memories"]] == [
        "ユーザーは紅茶が好き",
        "ユーザーは猫を飼っている",
    ]


async def test_pending_left_by_a_previous_run_is_extracted_at_start(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    leftover = MemoryFile(
        npc_id="ryokan-fumi",
        pending=(PendingLine(player="来月また泊まりに来るよ", npc="お待ちしております。", at=AT),),
    )
    (tmp_path / "ryokan-fumi.json").write_text(render(leftover))
    ollama.script('{"memories": ["ユーザーは来月また泊まりに来る予定"]}')
    async with running(make_keeper(tmp_path, backend)):
        request = await ollama.wait_for_requests(1)
        await eventually(lambda: read_file(tmp_path, "ryokan-fumi")["pending"] == [])
    assert "来月また泊まりに来るよ" in request.messages[1]["content"]
    assert "2026年9月29日" in request.messages[1]["content"]  # the day it was said, not the day of the restart
    assert [m["text"] for m in read_file(tmp_path, "ryokan-fumi")["memories"]] == ["ユーザーは来月また泊まりに来る予定"]


async def test_an_event_line_is_part_of_the_conversation(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_event("cafe-minori", text="お待たせしました、コーヒーです。", at=AT)
        assert read_file(tmp_path, "cafe-minori")["pending"] == [
            {"player": "", "npc": "お待たせしました、コーヒーです。", "at": "2026-09-29T21:12:40+09:00"}
        ]
        request = await ollama.wait_for_requests(1)
    assert "お待たせしました、コーヒーです。" in request.messages[1]["content"]


async def test_checked_candidates_are_kept_and_rejections_logged_with_their_rule(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script('{"memories": ["ユーザーは仕事で疲れている", "ユーザーは紅茶が好き", 42]}')
    with capture_logs() as logs:
        async with running(make_keeper(tmp_path, backend)) as keeper:
            await keeper.note_exchange("cafe-minori", player="紅茶がすき。疲れた", npc="はい。", at=AT)
            await eventually(lambda: any(e["event"] == "memory_extracted" for e in logs))
    rejected = [e for e in logs if e["event"] == "memory_rejected"]
    assert [e["rule"] for e in rejected] == ["mood", "not_a_string"]
    kept = [e for e in logs if e["event"] == "memory_kept"]
    assert len(kept) == 1


async def test_candidate_texts_are_logged_under_the_content_key_the_log_filter_gates(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script('{"memories": ["ユーザーは仕事で疲れている", "ユーザーは紅茶が好き"]}')
    # capture_logs sees the lines before the filter; tests/test_logs.py pins that the filter drops `text`.
    with capture_logs() as logs:
        async with running(make_keeper(tmp_path, backend)) as keeper:
            await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
            await eventually(lambda: any(e["event"] == "memory_extracted" for e in logs))
    assert [e["text"] for e in logs if e["event"] == "memory_rejected"] == ["ユーザーは仕事で疲れている"]
    assert [e["text"] for e in logs if e["event"] == "memory_kept"] == ["ユーザーは紅茶が好き"]


async def test_stored_memories_are_not_kept_twice(tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend) -> None:
    ollama.script(TEA, '{"memories": ["ユーザーは、紅茶が好き。"]}')
    async with running(make_keeper(tmp_path, backend)) as keeper:
        for _ in range(2):
            await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
            await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    assert len(ollama.requests) == 2
    assert [m["text"] for m in read_file(tmp_path, "cafe-minori")["memories"]] == ["ユーザーは紅茶が好き"]


async def test_replies_go_before_an_extraction(tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend) -> None:
    gate = LLMGate(1)
    async with running(make_keeper(tmp_path, backend, gate=gate)) as keeper:
        async with gate.slot(Priority.REPLY):  # a reply holds the only slot past the silence
            await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
            await asyncio.sleep(0.6)
            assert ollama.requests == []
        await ollama.wait_for_requests(1)


@pytest.mark.parametrize("fsync_delay", [0.0, 0.05], ids=["disk", "slow-disk"])
async def test_memories_told_to_one_npc_never_reach_another(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend, monkeypatch: pytest.MonkeyPatch, fsync_delay: float
) -> None:
    # With a slow folder fsync the file is on disk well before the write returns: what is seen on
    # disk must already be what recall gives (it once read a store that took a change only after).
    import bridge.memory.store as store_module

    real_fsync_dir = store_module._fsync_dir

    def slow_fsync_dir(directory: Path) -> None:
        real_fsync_dir(directory)
        time.sleep(fsync_delay)

    monkeypatch.setattr(store_module, "_fsync_dir", slow_fsync_dir)
    ollama.script(TEA)
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange("cafe-minori", player="ここの紅茶がすきなんだよ", npc="はい。", at=AT)
        await eventually(lambda: bool(read_file(tmp_path, "cafe-minori")["memories"]))
        assert await recalled_lines(keeper, "cafe-minori", "紅茶") == ["- (9/29) ユーザーは紅茶が好き"]
        assert await recalled_lines(keeper, "ryokan-fumi", "紅茶") == []
        assert await recalled_lines(keeper, "cinema-aoi", "紅茶") == []
    assert not (tmp_path / "ryokan-fumi.json").exists()


@pytest.mark.parametrize(("zone", "shown"), [("Asia/Tokyo", "(9/30)"), ("UTC", "(9/29)")])
async def test_recall_dates_memories_in_the_configured_zone(
    tmp_path: Path, backend: OllamaBackend, zone: str, shown: str
) -> None:
    late_evening_utc = datetime(2026, 9, 29, 23, 30, tzinfo=UTC)  # already 9/30 in Tokyo
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーは来週の土曜にキャンプに行く"], late_evening_utc, "extraction")
    keeper = make_keeper(tmp_path, backend, timezone=zone)
    assert await recalled_lines(keeper, "cafe-minori", "") == [f"- {shown} ユーザーは来週の土曜にキャンプに行く"]


async def test_recall_gives_the_newest_configured_number_oldest_first(tmp_path: Path, backend: OllamaBackend) -> None:
    store = MemoryStore(tmp_path, limit=60)
    for day in range(1, 6):
        await store.add_memories("cafe-minori", [f"ユーザーの記憶その{day}"], AT.replace(day=day), "extraction")
    keeper = make_keeper(tmp_path, backend, memory_recall=3)
    assert await recalled_lines(keeper, "cafe-minori", "") == [
        "- (9/3) ユーザーの記憶その3",
        "- (9/4) ユーザーの記憶その4",
        "- (9/5) ユーザーの記憶その5",
    ]
    assert await recalled_lines(make_keeper(tmp_path, backend, memory_recall=0), "cafe-minori", "") == []


async def test_inline_memories_are_checked_and_stored(tmp_path: Path, backend: OllamaBackend) -> None:
    keeper = make_keeper(tmp_path, backend)
    kept = await keeper.save_inline("cafe-minori", ["ユーザーは眠い", "ユーザーはジャズが好き", "ジャズが好き"], at=AT)
    assert kept == ["ユーザーはジャズが好き"]
    assert read_file(tmp_path, "cafe-minori")["memories"][0]["source"] == "inline"


async def test_an_inline_character_keeps_no_pending_conversation(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange("haruno", player="ただいま", npc="おかえり！", at=AT)
        await asyncio.sleep(0.5)
    assert ollama.requests == []
    assert not (tmp_path / "haruno.json").exists()


async def test_a_cancelled_keeper_leaves_no_task_behind(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend
) -> None:
    ollama.script(Answer.text(TEA, first_delay_seconds=10))
    async with running(make_keeper(tmp_path, backend)) as keeper:
        await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
        await ollama.wait_for_requests(1)
    # `running` asserts no memory task is left; the conversation stays for the next start.
    await keeper.flush(1.0)
    assert len(read_file(tmp_path, "cafe-minori")["pending"]) == 1


async def test_show_lines_numbers_memories_and_lists_pending(tmp_path: Path) -> None:
    memory = MemoryFile(
        npc_id="cafe-minori",
        memories=(
            Memory(text="ユーザーは紅茶が好き", heard_at=AT, source="extraction"),
            Memory(text="ユーザーは猫を飼っている", heard_at=AT, source="inline"),
        ),
        pending=(
            PendingLine(player="また来るね", npc="お待ちしています。", at=AT),
            PendingLine(player="", npc="コーヒーです。", at=AT),
        ),
    )
    text = "\n".join(show_lines(memory, JST))
    assert "  1. (2026-09-29 21:12) ユーザーは紅茶が好き" in text
    assert "  2. (2026-09-29 21:12) ユーザーは猫を飼っている" in text
    assert "また来るね" in text and "お待ちしています。" in text and "コーヒーです。" in text


async def test_forget_by_number_counts_from_one(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーの記憶A", "ユーザーの記憶B"], AT, "extraction")
    assert await forget_by_number(store, "cafe-minori", 1) == 1
    assert [m.text for m in (await store.load("cafe-minori")).memories] == ["ユーザーの記憶B"]
    assert await forget_by_number(store, "cafe-minori", None) == 1


async def test_a_conversation_that_never_goes_quiet_is_extracted_in_batches(
    tmp_path: Path, ollama: FakeOllama, backend: OllamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.keeper as keeper_module

    monkeypatch.setattr(keeper_module, "EXTRACTION_BATCH_LINES", 4)
    ollama.default = '{"memories": []}'
    async with running(make_keeper(tmp_path, backend, memory_silence_seconds=3600)) as keeper:
        for n in range(6):
            await keeper.note_exchange("cafe-minori", player=f"話{n}です", npc="はい。", at=AT)
        first = await ollama.wait_for_requests(1)
        await eventually(lambda: read_file(tmp_path, "cafe-minori")["pending"] == [])
    # No silence came: the long conversation went out at once, in batches of at most 4 lines.
    conversation = first.messages[1]["content"]
    assert all(f"話{n}です" in conversation for n in range(4)) and "話4です" not in conversation
    later = "".join(r.messages[1]["content"] for r in ollama.requests[1:])
    assert "話4です" in later and "話5です" in later and "話3です" not in later


async def test_while_the_model_is_down_the_pending_conversation_is_capped_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.keeper as keeper_module
    from tests.llm.helpers import refused_url

    monkeypatch.setattr(keeper_module, "MAX_PENDING_LINES", 3)
    dead = OllamaBackend(refused_url(), retry=FAST_RETRY)
    try:
        async with running(make_keeper(tmp_path, dead, memory_silence_seconds=3600)) as keeper:
            with capture_logs() as logs:
                for n in range(5):
                    await keeper.note_exchange("cafe-minori", player=f"話{n}です", npc="はい。", at=AT)
    finally:
        await dead.aclose()
    assert [p["player"] for p in read_file(tmp_path, "cafe-minori")["pending"]] == ["話2です", "話3です", "話4です"]
    assert [e["dropped"] for e in logs if e["event"] == "memory_pending_trimmed"] == [1, 1]
