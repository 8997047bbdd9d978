"""Sentence by sentence end to end: the daemon as a subprocess, real Colyseus 0.16 and 0.18 worlds, a fake LLM.

The reference world offers `say-parts` when asked (tests/world/README.md), records every
`npc:say:part` and checks the rules itself (`violations`: a part after its say, out of order, a
final say that is not the parts joined or not part 0's emotion, a part the world did not ask for).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import bridge_env, log_events, start_bridge, stop_bridge
from tests.fakes.llm_servers import Answer, FakeOllama, stall
from tests.world.harness import Version, WorldServer, node_available, running_world

TOKEN = "parts-world-token-31a7"
DEADLINE_SECONDS = 2.0

pytestmark = pytest.mark.world


def _texts(entries: list[dict[str, Any]]) -> list[str]:
    return [entry["text"] for entry in entries]


@pytest.mark.parametrize("version", ["0.16", "0.18"])
async def test_parts_reach_a_world_that_offers_them_and_stop_when_it_no_longer_does(
    version: Version, tmp_path: Path
) -> None:
    if not node_available():
        pytest.skip("node and npm are needed for the reference world (tests/world)")
    async with running_world(version, TOKEN, say_parts=True) as world, FakeOllama() as llm:
        llm.script(
            # 1. with the feature: every sentence a part, then the say
            Answer.text("[happy]いらっしゃいませ。今日は何にしますか？ごゆっくり。", piece_chars=2, delay_seconds=0.02),
            # 2. a banned word in part 1: the line ends with part 0
            Answer.text("いらっしゃいませ。殺人事件の映画ですね。", piece_chars=3, delay_seconds=0.02),
            # 3. the deadline after part 0: the line ends with part 0
            stall("[relaxed]少々", "お待ちください。", "ええと"),
            # 4. after a reconnect to a world that no longer offers parts: the say only
            Answer.text("[happy]またどうぞ。お気をつけて。", piece_chars=2),
        )
        env = bridge_env(
            tmp_path / "memory",
            NPC_BRIDGE_WORLD_URL=world.url,
            NPC_BRIDGE_WORLD_TOKEN=TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            NPC_BRIDGE_REPLY_DEADLINE_SECONDS=str(DEADLINE_SECONDS),
            NPC_BRIDGE_MEMORY_SILENCE_SECONDS="3600",
        )
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)
        try:
            await world.wait_for_worker(30)
            await _with_the_feature(world)
            await _banned_word_in_part_1(world)
            await _deadline_after_part_0(world)
            await _world_stops_offering_parts(world)
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    said = [e for e in log_events(log_path) if e.get("event") == "reply_said"]
    assert [e["parts"] for e in said] == [2, 1, 1, 0]
    assert [e["cut_rule"] for e in said] == [None, "banned_word", None, None]
    assert all(e["first_part_ms"] > 0 for e in said[:3]) and said[3]["first_part_ms"] is None


async def _say_for(world: WorldServer, event_id: str) -> dict[str, Any]:
    return await world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=20.0)


async def _with_the_feature(world: WorldServer) -> None:
    event_id = await world.inject_talk("cafe-minori", "alice", "こんにちは")
    say = await _say_for(world, event_id)
    assert _texts(await world.parts(event_id)) == ["いらっしゃいませ。", "今日は何にしますか？"]
    assert (say["text"], say["emotion"], say["source"]) == (
        "いらっしゃいませ。今日は何にしますか？",
        "happy",
        "generated",
    )
    record = await world.record()
    part_at = next(e["at"] for e in record["parts"] if e["payload"]["replyTo"] == event_id)
    said_at = next(e["at"] for e in record["said"] if e["payload"]["replyTo"] == event_id)
    assert part_at < said_at  # part 0 was shown while the model still wrote the second sentence
    assert await world.violations() == []


async def _banned_word_in_part_1(world: WorldServer) -> None:
    event_id = await world.inject_talk("cafe-minori", "bob", "映画の話をしよう")
    say = await _say_for(world, event_id)
    assert _texts(await world.parts(event_id)) == ["いらっしゃいませ。"]
    assert (say["text"], say["source"]) == ("いらっしゃいませ。", "generated")
    assert await world.violations() == []


async def _deadline_after_part_0(world: WorldServer) -> None:
    started = time.monotonic()
    event_id = await world.inject_talk("cafe-minori", "carol", "すみません")
    say = await _say_for(world, event_id)
    assert time.monotonic() - started < DEADLINE_SECONDS + 1.0
    assert _texts(await world.parts(event_id)) == ["少々お待ちください。"]
    assert (say["text"], say["emotion"], say["source"]) == ("少々お待ちください。", "relaxed", "generated")
    assert await world.violations() == []


async def _world_stops_offering_parts(world: WorldServer) -> None:
    claims = len((await world.record())["claimed"])
    await world.set_say_parts(False)
    await world.drop_workers()
    await world.wait_for(lambda r: len(r["claimed"]) > claims, timeout=30)
    event_id = await world.inject_talk("cafe-minori", "dave", "またね")
    say = await _say_for(world, event_id)
    assert await world.parts(event_id) == []
    assert (say["text"], say["emotion"]) == ("またどうぞ。お気をつけて。", "happy")
    assert await world.violations() == []
