"""`npc-bridge chat --explain`: which memories went into each prompt, and why."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

from bridge.chat import explain_lines
from bridge.memory.recall import Recalled
from tests.fakes.llm_servers import FakeOllama
from tests.test_cli import BRIDGE, env_for

JST = timezone(timedelta(hours=9))
BONSAI = "ユーザーは盆栽を育てている"
FILLER = [f"ユーザーは{thing}が好き" for thing in "海花夏冬猫犬山川雨雪空星"]


def test_explain_lines_say_recent_or_relevant_with_score_and_shared_terms() -> None:
    lines = explain_lines(
        [
            Recalled(BONSAI, datetime(2026, 6, 27, 20, tzinfo=JST), "relevant", score=3.6712, matched=("盆栽",)),
            Recalled("ユーザーは海が好き", datetime(2026, 9, 27, 20, tzinfo=JST), "recent"),
        ]
    )
    assert lines == [
        f"    [memory] - (6/27) {BONSAI}   <- relevant 3.67 (盆栽)",
        "    [memory] - (9/27) ユーザーは海が好き   <- recent",
    ]
    assert explain_lines([]) == ["    [memory] none recalled"]
    shared = explain_lines([Recalled(BONSAI, None, "relevant")])
    assert shared == [f"    [memory] - {BONSAI}   <- relevant (memory service)"]


async def test_chat_explain_shows_the_memories_of_each_prompt_before_the_reply(tmp_path: Path) -> None:
    memory_dir = tmp_path / "memory"
    memory_dir.mkdir()
    start = datetime(2026, 6, 1, 20, tzinfo=JST)
    texts = [BONSAI, *FILLER]
    memories = [
        {"text": text, "heard_at": (start + timedelta(days=n)).isoformat(), "source": "extraction"}
        for n, text in enumerate(texts)
    ]
    content = {"version": 1, "npc_id": "cafe-minori", "memories": memories, "pending": []}
    (memory_dir / "cafe-minori.json").write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    async with FakeOllama(default="いいですね。") as llm:
        proc = await asyncio.create_subprocess_exec(
            *BRIDGE,
            "chat",
            "cafe-minori",
            "--explain",
            env=env_for(tmp_path, NPC_BRIDGE_LLM_URL=llm.url, NPC_BRIDGE_MEMORY_RECALL="4"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate("盆栽の枝がのびすぎちゃって\n".encode()), 60)
    assert proc.returncode == 0, err.decode()
    # (The first line follows the "> " that input() printed.)
    shown = [line.removeprefix("> ") for line in out.decode().splitlines() if "[memory]" in line]
    assert shown[0].startswith(f"    [memory] - (6/1) {BONSAI}   <- relevant ")
    assert shown[0].endswith("(盆栽)")
    assert [line.rsplit("<- ", 1)[1] for line in shown[1:]] == ["recent"] * 3
    assert [line.split(") ", 1)[1].split("   <-")[0] for line in shown[1:]] == FILLER[-3:]
    (request,) = llm.requests
    assert f"- (6/1) {BONSAI}" in request.messages[1]["content"]
