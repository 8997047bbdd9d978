"""`npc-bridge chat` and the daemon's dispatcher go through one reply path (bridge/npc/turns.py).

Both are driven with one fake LLM and the same player line: the model is asked the same thing,
the same cleaned and checked line comes back, and the same exchange is noted as pending memory.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.daemon import BRIDGE, bridge_env
from tests.npc.rig import Rig, talk

RAW = "[happy]みのり：いらっしゃいませ！今日は何にしますか？<コーヒーを運ぶ>ごゆっくり。"
LINE = "ここの紅茶がすきなんだよ"


def _pending(memory_dir: Path) -> list[dict[str, str]]:
    data = json.loads((memory_dir / "cafe-minori.json").read_text(encoding="utf-8"))
    return [{"player": p["player"], "npc": p["npc"]} for p in data["pending"]]


@pytest.mark.parametrize("rig", [{"parts": True}], indirect=True)
async def test_chat_and_the_daemon_answer_a_line_the_same_way(rig: Rig, tmp_path: Path) -> None:
    rig.server.default = RAW
    rig.dispatcher.handle(talk("cafe-minori", "alice", LINE, name="あなた"))  # chat's player name
    (say,) = await rig.world.wait_says(1)
    await rig.dispatcher.drain(1.0)  # the exchange is written to the pending memory

    chat_memory = tmp_path / "chat-memory"
    proc = await asyncio.create_subprocess_exec(
        *BRIDGE,
        "chat",
        "cafe-minori",
        env=bridge_env(chat_memory, NPC_BRIDGE_LLM_URL=rig.server.url),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(f"{LINE}\n".encode()), 60)
    assert proc.returncode == 0, err.decode()

    daemon_request, chat_request = rig.server.requests
    assert chat_request.messages == daemon_request.messages
    assert (say.text, say.emotion, say.source) == ("いらっしゃいませ！今日は何にしますか？", "happy", "generated")
    # chat prints the parts as they come, on the NPC's one line
    assert [p.text for p in rig.world.parts] == ["いらっしゃいませ！", "今日は何にしますか？"]
    assert f"みのり: {say.text}\n" in out.decode()
    assert "[happy, generated," in out.decode()
    assert _pending(chat_memory) == _pending(rig.memory_dir) == [{"player": LINE, "npc": say.text}]
