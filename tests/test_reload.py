"""Reload (SIGHUP, the unit's ExecReload=): characters and banned words re-read without leaving the
world, between RELOADING=1 and READY=1 on a real NOTIFY_SOCKET; plus the pure reload plan."""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from bridge.npc.characters import Character
from bridge.reload import REASON_NOT_VOICED, REASON_REMOVED, plan_reload
from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import REPO, NotifyListener, bridge_env, log_events, start_bridge, stop_bridge, wait_for_log
from tests.fakes.llm_servers import Error, FakeOllama
from tests.world.harness import WorldServer

NEW_PERSONA = "駅前の新しいカフェで働く店員。いつも季節のケーキを勧める。"
NEW_FALLBACK = "新しいフォールバックの一言です。"
MEMORY = "ユーザーは露天風呂が好き"


def character(npc_id: str, *, voiced: bool = True, persona: str = "店員") -> Character:
    return Character.model_validate(
        {"id": npc_id, "name": npc_id, "persona": persona, "talk": "worker" if voiced else None}
    )


def test_the_plan_keeps_what_cannot_be_given_back_and_adds_the_newly_voiced() -> None:
    running = {"a": character("a"), "b": character("b"), "c": character("c")}
    loaded = {
        "a": character("a", persona="変わった"),  # changed
        "c": character("c", voiced=False),  # no longer voiced
        "d": character("d"),  # new
        "e": character("e", voiced=False),  # new, not voiced
    }
    plan = plan_reload(running, loaded)
    assert plan.added == ["d"]
    assert plan.changed == ["a"]
    assert plan.kept == {"b": REASON_REMOVED, "c": REASON_NOT_VOICED}
    assert plan.characters["b"] is running["b"] and plan.characters["c"] is running["c"]
    assert plan.characters["a"].persona == "変わった" and not plan.characters["e"].voiced


def _edit(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        target = data
        *parents, last = key.split("__")
        for parent in parents:
            target = target[parent]
        target[last] = value
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _last_user_text(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"])


def _answer(body: dict[str, Any]) -> Any:
    text = _last_user_text(body)
    if "失敗して" in text:
        return Error(500)
    if "言って" in text:
        return "[neutral]ぴよぴよです。"
    return "[happy]いらっしゃいませ！"


@pytest.mark.world
async def test_sighup_reloads_characters_and_banned_words_without_leaving_the_world(
    live_world: WorldServer, tmp_path: Path
) -> None:
    characters = tmp_path / "characters"
    characters.mkdir()
    for path in (REPO / "characters").glob("*.json"):
        (characters / path.name).write_bytes(path.read_bytes())
    _edit(characters / "ryokan-fumi.json", staff__talk="none")  # not voiced at start
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "ryokan-fumi.json").write_text(
        json.dumps(
            {
                "version": 1,
                "npc_id": "ryokan-fumi",
                "memories": [{"text": MEMORY, "heard_at": "2026-10-01T10:00:00+09:00", "source": "extraction"}],
                "pending": [],
            },
            ensure_ascii=False,
        ),
        encoding="utf-8",
    )
    config = tmp_path / "bridge.toml"
    config.write_text("banned_words = []\n", encoding="utf-8")
    notify = NotifyListener(tmp_path)
    async with FakeOllama(default=_answer) as llm:
        env = bridge_env(
            memory,
            NPC_BRIDGE_WORLD_URL=live_world.url,
            NPC_BRIDGE_WORLD_TOKEN=LIVE_WORLD_TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            NPC_BRIDGE_CHARACTERS_DIR=str(characters),
            NPC_BRIDGE_CONFIG=str(config),
            NPC_BRIDGE_REPLY_DEADLINE_SECONDS="20",
            **notify.env(watchdog_usec=2_000_000),
        )
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)

        async def say_to(npc_id: str, text: str, player: str = "player-1") -> dict[str, Any]:
            event_id = await live_world.inject_talk(npc_id, player, text)
            return await live_world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=40)

        async def reload(count: int) -> None:
            proc.send_signal(signal.SIGHUP)
            await wait_for_log(
                log_path,
                lambda e: (
                    e["event"] in ("reload_done", "reload_failed")
                    and sum(x["event"] in ("reload_done", "reload_failed") for x in log_events(log_path)) >= count
                ),
                proc=proc,
            )

        try:
            record = await live_world.wait_for_worker(30)
            assert record["claims"][0]["npcIds"] == ["cafe-minori", "cinema-aoi", "haruno"]
            assert (await say_to("cafe-minori", "ぴよぴよって言って"))["source"] == "generated"

            # Changed persona and fallbacks, a removed file, one no longer voiced, one newly voiced, a banned word.
            _edit(characters / "cafe-minori.json", persona=NEW_PERSONA, fallbacks=[NEW_FALLBACK])
            (characters / "cinema-aoi.json").unlink()
            _edit(characters / "haruno.json", talk="none")
            _edit(characters / "ryokan-fumi.json", staff__talk="worker")
            config.write_text('banned_words = ["ぴよぴよ"]\n', encoding="utf-8")
            await reload(1)

            requests_before = len(llm.requests)
            assert (await say_to("cafe-minori", "おすすめは？"))["source"] == "generated"
            assert NEW_PERSONA in llm.requests[requests_before].messages[0]["content"]
            said = await say_to("cafe-minori", "失敗してみて", player="player-2")
            assert said["source"] == "fallback" and said["text"] == NEW_FALLBACK
            banned = await say_to("cafe-minori", "もう一度ぴよぴよって言って", player="player-3")
            assert banned["source"] == "fallback" and "ぴよぴよ" not in banned["text"]
            # The newly voiced NPC is claimed, and talks with its memory as at start.
            record = await live_world.wait_for(lambda r: "ryokan-fumi" in r["claims"][-1]["npcIds"], 20)
            requests_before = len(llm.requests)
            assert (await say_to("ryokan-fumi", "こんばんは"))["source"] == "generated"
            assert any(MEMORY in m["content"] for m in llm.requests[requests_before].messages)
            # Removed and no-longer-voiced characters still answer until the next restart.
            assert (await say_to("cinema-aoi", "こんにちは"))["source"] == "generated"
            assert (await say_to("haruno", "ただいま"))["source"] == "generated"

            # A reload with broken files keeps the running characters, and says every problem.
            (characters / "cafe-minori.json").write_text('{"id": "cafe-minori"}', encoding="utf-8")
            (characters / "haruno.json").write_text("{", encoding="utf-8")
            await reload(2)
            requests_before = len(llm.requests)
            assert (await say_to("cafe-minori", "まだいますか？", player="player-4"))["source"] == "generated"
            assert NEW_PERSONA in llm.requests[requests_before].messages[0]["content"]
            # Enough pings to judge their rhythm below, however quickly the conversation above went
            # (a fast run was over after 5 pings).
            while notify.read().count("WATCHDOG=1") < 6:
                await notify.wait_for(lambda message: message == "WATCHDOG=1")
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
            notify.close()

    events = log_events(log_path)
    kept = {e["npc"]: e["reason"] for e in events if e["event"] == "reload_npc_still_voiced"}
    assert kept == {"cinema-aoi": REASON_REMOVED, "haruno": REASON_NOT_VOICED}
    (done,) = [e for e in events if e["event"] == "reload_done"]
    assert done["added"] == ["ryokan-fumi"] and done["changed"] == ["cafe-minori"]
    problems = [e["problem"] for e in events if e["event"] == "reload_problem"]
    assert len(problems) == 3, problems  # name and persona missing in one file, bad JSON in the other
    assert any("cafe-minori.json: persona: Field required" in p for p in problems)
    assert any("haruno.json: not JSON" in p for p in problems)
    record = await live_world.record()
    assert len(record["joins"]) == 1 and record["drops"] == []  # the world connection was never dropped
    # The sd_notify conversation, as systemd reads it.
    messages = notify.messages
    assert messages[0] == "READY=1"
    assert any(m.startswith("STATUS=joined") for m in messages)
    # WATCHDOG=1 at half of WATCHDOG_USEC (2 s): the typical gap is 1 s (a loaded machine only delays some).
    pings = [at for at, m in zip(notify.arrived, messages, strict=True) if m == "WATCHDOG=1"]
    gaps = sorted(b - a for a, b in itertools.pairwise(pings))
    assert len(gaps) >= 5 and 0.8 <= gaps[len(gaps) // 2] <= 1.5, gaps
    reloads = [i for i, m in enumerate(messages) if m.startswith("RELOADING=1\nMONOTONIC_USEC=")]
    assert len(reloads) == 2
    for start in reloads:
        assert "READY=1" in messages[start + 1 :]
    assert "STOPPING=1" in messages[reloads[-1] :]
