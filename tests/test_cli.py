"""The commands a person types: `chat`, `memory show`, `memory forget`, and their exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.llm_servers import FakeOllama

REPO = Path(__file__).resolve().parent.parent
BRIDGE = [sys.executable, "-m", "bridge"]
MEMORY_FILE = {
    "version": 1,
    "npc_id": "cafe-minori",
    "memories": [
        {"text": "ユーザーは紅茶が好き", "heard_at": "2026-09-29T21:14:03+09:00", "source": "extraction"},
        {"text": "ユーザーは猫を飼っている", "heard_at": "2026-10-02T10:00:00+09:00", "source": "extraction"},
        {"text": "ユーザーはSF映画が好き", "heard_at": "2026-10-05T18:30:00+09:00", "source": "extraction"},
    ],
    "pending": [{"player": "また来るね", "npc": "お待ちしています。", "at": "2026-10-06T12:00:00+09:00"}],
}


def env_for(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPC_BRIDGE_")}
    env.update(
        NPC_BRIDGE_CHARACTERS_DIR=str(REPO / "characters"),
        NPC_BRIDGE_MEMORY_DIR=str(tmp_path / "memory"),
        NPC_BRIDGE_TIMEZONE="Asia/Tokyo",
        PYTHONUNBUFFERED="1",
    )
    env.update(values)
    return env


def bridge(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BRIDGE, *args], env=env_for(tmp_path), capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def memory_file(tmp_path: Path) -> Path:
    (tmp_path / "memory").mkdir()
    path = tmp_path / "memory" / "cafe-minori.json"
    path.write_text(json.dumps(MEMORY_FILE, ensure_ascii=False), encoding="utf-8")
    return path


def test_help_lists_every_command(tmp_path: Path) -> None:
    result = bridge(tmp_path, "--help")
    assert result.returncode == 0
    for command in ("run", "check", "chat", "memory"):
        assert command in result.stdout


def test_memory_show_prints_dated_numbered_memories_and_pending_lines(tmp_path: Path, memory_file: Path) -> None:
    result = bridge(tmp_path, "memory", "show", "cafe-minori")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "  1. (2026-09-29 21:14) ユーザーは紅茶が好き" in out
    assert "  3. (2026-10-05 18:30) ユーザーはSF映画が好き" in out
    assert "pending conversation: 1 lines" in out and "また来るね" in out


def test_memory_forget_one_by_its_number(tmp_path: Path, memory_file: Path) -> None:
    result = bridge(tmp_path, "memory", "forget", "cafe-minori", "2")
    assert result.returncode == 0, result.stderr
    texts = [m["text"] for m in json.loads(memory_file.read_text(encoding="utf-8"))["memories"]]
    assert texts == ["ユーザーは紅茶が好き", "ユーザーはSF映画が好き"]


def test_memory_forget_all(tmp_path: Path, memory_file: Path) -> None:
    result = bridge(tmp_path, "memory", "forget", "cafe-minori", "--all")
    assert result.returncode == 0, result.stderr
    assert "forgot 3 memories" in result.stdout
    data = json.loads(memory_file.read_text(encoding="utf-8"))
    assert data["memories"] == [] and len(data["pending"]) == 1


def test_memory_forget_a_number_that_does_not_exist_exits_1(tmp_path: Path, memory_file: Path) -> None:
    result = bridge(tmp_path, "memory", "forget", "cafe-minori", "9")
    assert result.returncode == 1
    assert "no memory number 9" in result.stderr
    assert len(json.loads(memory_file.read_text(encoding="utf-8"))["memories"]) == 3


def test_memory_of_an_unknown_npc_exits_1(tmp_path: Path) -> None:
    result = bridge(tmp_path, "memory", "show", "nobody-here")
    assert result.returncode == 1 and "nobody-here" in result.stderr


def test_memory_forget_needs_a_number_or_all(tmp_path: Path) -> None:
    result = bridge(tmp_path, "memory", "forget", "cafe-minori")
    assert result.returncode == 2  # argparse usage error


async def test_chat_talks_through_the_daemons_prompt_cleaning_and_memory(tmp_path: Path) -> None:
    async with FakeOllama(default="[happy]みのり：いらっしゃいませ！今日は何にしますか？<コーヒーを運ぶ>") as llm:
        proc = await asyncio.create_subprocess_exec(
            *BRIDGE,
            "chat",
            "cafe-minori",
            env=env_for(tmp_path, NPC_BRIDGE_LLM_URL=llm.url),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate("ここの紅茶がすきなんだよ\n".encode()), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "みのり: いらっしゃいませ！今日は何にしますか？" in text
    assert "[happy, generated," in text
    (request,) = llm.requests
    assert request.messages[0]["role"] == "system" and "カフェのみのり" in request.messages[0]["content"]
    assert request.messages[-1] == {"role": "user", "content": "ここの紅茶がすきなんだよ"}
    pending = json.loads((tmp_path / "memory" / "cafe-minori.json").read_text(encoding="utf-8"))["pending"]
    assert pending[0]["player"] == "ここの紅茶がすきなんだよ"
    assert pending[0]["npc"] == "いらっしゃいませ！今日は何にしますか？"


def test_chat_with_an_unknown_character_exits_2(tmp_path: Path) -> None:
    result = bridge(tmp_path, "chat", "nobody-here")
    assert result.returncode == 2 and "nobody-here" in result.stderr


@pytest.mark.parametrize("command", [("memory", "show", "cafe-minori"), ("check",)])
def test_a_reader_that_leaves_early_gets_no_traceback(
    tmp_path: Path, memory_file: Path, command: tuple[str, ...]
) -> None:
    # `npc-bridge check | head -1`: the pipe is closed before the command writes, so every print fails.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*BRIDGE, *command],
            env=env_for(tmp_path, NPC_BRIDGE_WORLD_URL="http://127.0.0.1:9", NPC_BRIDGE_LLM_URL="http://127.0.0.1:9"),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr
    assert "BrokenPipeError" not in result.stderr
