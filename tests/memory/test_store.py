"""The memory files: atomic writes, corrupt files set aside, the limit, pending across restarts."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bridge.errors import MemoryStoreError
from bridge.memory.models import MemoryFile, PendingLine
from bridge.memory.store import MemoryStore

JST = timezone(timedelta(hours=9))
AT = datetime(2026, 9, 29, 21, 12, 40, tzinfo=JST)


def line(n: int) -> PendingLine:
    return PendingLine(player=f"プレイヤーの言葉{n}", npc=f"店員の返事{n}", at=AT + timedelta(seconds=n))


def files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


async def test_the_file_has_the_documented_shape(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーはコーヒーではなく紅茶を好む"], AT, "extraction")
    await store.append_pending(
        "cafe-minori", PendingLine(player="ここの紅茶がすきなんだよ", npc="紅茶、お好きなんですね。", at=AT)
    )
    data = json.loads((tmp_path / "cafe-minori.json").read_text(encoding="utf-8"))
    assert data == {
        "version": 1,
        "npc_id": "cafe-minori",
        "memories": [
            {
                "text": "ユーザーはコーヒーではなく紅茶を好む",
                "heard_at": "2026-09-29T21:12:40+09:00",
                "source": "extraction",
            }
        ],
        "pending": [
            {
                "player": "ここの紅茶がすきなんだよ",
                "npc": "紅茶、お好きなんですね。",
                "at": "2026-09-29T21:12:40+09:00",
            }
        ],
    }


async def test_writes_leave_no_temporary_file_and_the_file_is_always_valid_json(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    seen_invalid: list[str] = []
    stop = asyncio.Event()

    async def reader() -> None:
        # Read the file as another process would, over and over, while the writes go on.
        path = tmp_path / "cafe-minori.json"
        while not stop.is_set():
            if path.exists():
                text = await asyncio.to_thread(path.read_text, encoding="utf-8")
                try:
                    json.loads(text)
                except ValueError:
                    seen_invalid.append(text)
            await asyncio.sleep(0)

    reading = asyncio.create_task(reader())
    await asyncio.gather(*(store.append_pending("cafe-minori", line(n)) for n in range(40)))
    stop.set()
    await reading
    assert seen_invalid == []
    assert files_in(tmp_path) == ["cafe-minori.json"]
    assert len((await MemoryStore(tmp_path, limit=60).load("cafe-minori")).pending) == 40


async def test_a_cancelled_caller_does_not_cancel_the_write(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    task = asyncio.create_task(store.append_pending("cafe-minori", line(1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.flush(5.0)
    assert len((await MemoryStore(tmp_path, limit=60).load("cafe-minori")).pending) == 1
    assert files_in(tmp_path) == ["cafe-minori.json"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"version": 1, "npc_id": "cafe-minori", "memories": [{"text": "x"}]}',
        '{"version": 2, "npc_id": "cafe-minori"}',
        '{"version": 1, "npc_id": "cafe-minori", "pending": '
        '[{"player": "a", "npc": "b", "at": "2026-09-29T21:12:40"}]}',  # a time without its offset
        "[]",
    ],
)
async def test_a_corrupt_file_is_moved_aside_and_the_npc_starts_empty(tmp_path: Path, content: str) -> None:
    (tmp_path / "cafe-minori.json").write_text(content, encoding="utf-8")
    store = MemoryStore(tmp_path, limit=60)
    with capture_logs() as logs:
        assert (await store.load("cafe-minori")).memories == ()
    corrupt = [entry for entry in logs if entry["event"] == "memory_file_corrupt"]
    assert len(corrupt) == 1 and corrupt[0]["log_level"] == "error"
    assert corrupt[0]["path"] == str(tmp_path / "cafe-minori.json")
    names = files_in(tmp_path)
    assert len(names) == 1 and names[0].startswith("cafe-minori.json.corrupt-")
    assert (tmp_path / names[0]).read_text(encoding="utf-8") == content  # kept for a person to look at

    await store.add_memories("cafe-minori", ["ユーザーは紅茶が好き"], AT, "extraction")
    reopened = MemoryStore(tmp_path, limit=60)
    assert [m.text for m in (await reopened.load("cafe-minori")).memories] == ["ユーザーは紅茶が好き"]


async def test_past_the_limit_the_oldest_memories_are_forgotten(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    for n in range(58):
        await store.add_memories("cafe-minori", [f"ユーザーの記憶{n}"], AT, "extraction")
    await store.add_memories(
        "cafe-minori", ["ユーザーの記憶58", "ユーザーの記憶59", "ユーザーの記憶60"], AT, "extraction"
    )
    texts = [m.text for m in (await MemoryStore(tmp_path, limit=60).load("cafe-minori")).memories]
    assert len(texts) == 60
    assert texts[0] == "ユーザーの記憶1"
    assert texts[-1] == "ユーザーの記憶60"


async def test_pending_survives_a_new_store(tmp_path: Path) -> None:
    await MemoryStore(tmp_path, limit=60).append_pending("cafe-minori", line(1))
    reopened = MemoryStore(tmp_path, limit=60)
    assert (await reopened.load("cafe-minori")).pending == (line(1),)
    assert await reopened.npc_ids_with_pending() == ["cafe-minori"]


async def test_clear_pending_keeps_lines_noted_after_the_extraction_began(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.append_pending("cafe-minori", line(1))
    await store.append_pending("cafe-minori", line(2))
    taken = len((await store.load("cafe-minori")).pending)
    await store.append_pending("cafe-minori", line(3))  # said while the extraction ran
    await store.clear_pending("cafe-minori", taken)
    assert (await MemoryStore(tmp_path, limit=60).load("cafe-minori")).pending == (line(3),)


async def test_forget_one_or_all(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーの記憶0", "ユーザーの記憶1", "ユーザーの記憶2"], AT, "extraction")
    assert await store.forget("cafe-minori", 1) == 1
    assert [m.text for m in (await store.load("cafe-minori")).memories] == ["ユーザーの記憶0", "ユーザーの記憶2"]
    with pytest.raises(IndexError):
        await store.forget("cafe-minori", 5)
    assert await store.forget("cafe-minori", None) == 2
    assert (await MemoryStore(tmp_path, limit=60).load("cafe-minori")).memories == ()


async def test_each_npc_has_its_own_file(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーは紅茶が好き"], AT, "extraction")
    await store.append_pending("ryokan-fumi", line(1))
    assert (await store.load("ryokan-fumi")).memories == ()
    assert (await store.load("cafe-minori")).pending == ()
    assert files_in(tmp_path) == ["cafe-minori.json", "ryokan-fumi.json"]
    assert await MemoryStore(tmp_path, limit=60).npc_ids_with_pending() == ["ryokan-fumi"]


@pytest.mark.parametrize("npc_id", ["../etc", "Cafe", "", "a/b"])
async def test_an_id_that_is_not_a_safe_file_name_is_refused(tmp_path: Path, npc_id: str) -> None:
    with pytest.raises(MemoryStoreError):
        await MemoryStore(tmp_path, limit=60).append_pending(npc_id, line(1))


async def test_the_memory_folder_is_created_on_first_write(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "state" / "memory", limit=60)
    assert await store.npc_ids_with_pending() == []
    await store.append_pending("cafe-minori", line(1))
    assert (tmp_path / "state" / "memory" / "cafe-minori.json").is_file()


async def test_times_keep_their_offset(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, limit=60)
    await store.add_memories("cafe-minori", ["ユーザーは紅茶が好き"], datetime(2026, 9, 29, 12, tzinfo=UTC), "inline")
    data = json.loads((tmp_path / "cafe-minori.json").read_text(encoding="utf-8"))
    assert data["memories"][0]["heard_at"] == "2026-09-29T12:00:00+00:00"


async def test_a_read_during_a_slow_write_sees_the_change_without_waiting_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.store as store_module

    store = MemoryStore(tmp_path, limit=60)
    await store.append_pending("cafe-minori", PendingLine(player="一", npc="はい。", at=AT))
    slow = asyncio.Event()
    real_fsync = store_module._fsync_dir

    def slow_fsync_dir(directory: Path) -> None:
        real_fsync(directory)
        give_up = time.monotonic() + 2.0
        while not slow.is_set() and time.monotonic() < give_up:  # a slow disk, until the test has read
            time.sleep(0.005)

    monkeypatch.setattr(store_module, "_fsync_dir", slow_fsync_dir)
    writing = asyncio.create_task(store.append_pending("cafe-minori", PendingLine(player="二", npc="はい。", at=AT)))
    await asyncio.sleep(0.05)
    assert not writing.done()  # the caller of a change waits for the disk
    try:
        seen = await asyncio.wait_for(store.load("cafe-minori"), 0.5)  # a read does not
    finally:
        slow.set()
    # Whatever is on disk (or about to be) is already what a read sees: a test (or the daemon) that
    # sees a line in the file never reads an older memory from the store.
    assert [line.player for line in seen.pending] == ["一", "二"]
    await writing
    assert [p["player"] for p in json.loads((tmp_path / "cafe-minori.json").read_text())["pending"]] == ["一", "二"]


def test_the_file_is_one_item_a_line_and_round_trips() -> None:
    from bridge.memory.store import render

    data = {
        "version": 1,
        "npc_id": "cafe-minori",
        "memories": [
            {"text": "ユーザーは紅茶が好き", "heard_at": "2026-09-29T21:14:03+09:00", "source": "extraction"},
            {"text": 'ユーザーは"引用"も書く', "heard_at": "2026-09-30T10:00:00+09:00", "source": "inline"},
        ],
        "pending": [],
    }
    text = render(MemoryFile.model_validate(data))
    assert json.loads(text) == data
    assert '    {"text": "ユーザーは紅茶が好き", "heard_at"' in text.splitlines()[4]
    assert text.endswith("}\n")


async def test_a_failed_write_of_a_memory_command_leaves_file_memory_and_folder_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.store as store_module

    store = MemoryStore(tmp_path, limit=60, keep_unwritten=False)  # as `npc-bridge memory ...` makes it
    await store.append_pending("cafe-minori", PendingLine(player="一", npc="はい。", at=AT))
    before = (tmp_path / "cafe-minori.json").read_bytes()

    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "replace", full_disk)
    with pytest.raises(MemoryStoreError, match="No space left"):
        await store.append_pending("cafe-minori", PendingLine(player="二", npc="はい。", at=AT))

    assert files_in(tmp_path) == ["cafe-minori.json"]  # the temporary file is gone
    assert (tmp_path / "cafe-minori.json").read_bytes() == before
    assert [line.player for line in (await store.load("cafe-minori")).pending] == ["一"]


async def test_the_daemons_store_keeps_what_the_disk_refused_and_writes_it_once_it_takes_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.store as store_module

    store = MemoryStore(tmp_path, limit=60, retry_base_seconds=0.02)
    await store.append_pending("cafe-minori", PendingLine(player="一", npc="はい。", at=AT))
    real_replace = store_module.os.replace
    refusing = True

    def full_disk(src: str, dst: str) -> None:
        if refusing:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(store_module.os, "replace", full_disk)
    with capture_logs() as logs:
        for word in ("二", "三", "四"):  # the caller goes on: nothing raised, nothing waited for
            noted = store.append_pending("cafe-minori", PendingLine(player=word, npc="はい。", at=AT))
            await asyncio.wait_for(noted, 1)
        assert [line.player for line in (await store.load("cafe-minori")).pending] == ["一", "二", "三", "四"]
        await asyncio.sleep(0.2)  # several retries fail meanwhile
        assert files_in(tmp_path) == ["cafe-minori.json"]  # never a temporary file left behind
        assert [p["player"] for p in json.loads((tmp_path / "cafe-minori.json").read_text())["pending"]] == ["一"]
        refusing = False
        assert await store.flush(5.0)
    on_disk = json.loads((tmp_path / "cafe-minori.json").read_text())["pending"]
    assert [p["player"] for p in on_disk] == ["一", "二", "三", "四"]
    assert files_in(tmp_path) == ["cafe-minori.json"]
    events = [entry["event"] for entry in logs]
    assert events.count("memory_write_failed") == 1  # one warning a minute, not one per line or retry
    assert events.count("memory_write_recovered") == 1


async def test_flush_tries_a_refused_write_again_at_once_and_names_what_stays_unwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.store as store_module

    store = MemoryStore(tmp_path, limit=60, retry_base_seconds=20.0)  # a backoff longer than the test
    real_replace = store_module.os.replace
    refusing = True

    def full_disk(src: str, dst: str) -> None:
        if refusing:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(store_module.os, "replace", full_disk)
    await store.append_pending("cafe-minori", PendingLine(player="一", npc="はい。", at=AT))
    await asyncio.sleep(0.05)  # the writer has failed and waits out its backoff
    with capture_logs() as logs:
        assert not await store.flush(0.2)  # shutdown on a full disk: what is lost is named
    assert [(e["event"], e["npc_ids"]) for e in logs if e["event"] == "memory_flush_timeout"] == [
        ("memory_flush_timeout", ["cafe-minori"])
    ]
    refusing = False
    assert await store.flush(2.0)  # room again: written now, not after the 20 s backoff
    assert [p["player"] for p in json.loads((tmp_path / "cafe-minori.json").read_text())["pending"]] == ["一"]
