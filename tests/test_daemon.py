"""The daemon as a person runs it: a real `npc-bridge` process, a real Colyseus world, a loopback LLM."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import BRIDGE, REPO, NotifyListener, bridge_env, log_events, start_bridge, stop_bridge
from tests.fakes.llm_servers import FakeOllama
from tests.world.harness import WorldServer

TOKEN = LIVE_WORLD_TOKEN


def env_for(tmp_path: Path, **values: str) -> dict[str, str]:
    return bridge_env(tmp_path / "memory", **values)


def test_missing_token_exits_2_with_one_line_before_connecting(tmp_path: Path) -> None:
    result = subprocess.run(
        [*BRIDGE, "run"], env=env_for(tmp_path), capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "npc-bridge: configuration error: NPC_BRIDGE_WORLD_TOKEN: required to run "
        "(set it, or NPC_BRIDGE_WORLD_TOKEN_FILE, or the systemd credential world-token)"
    ]


def test_bad_value_exits_2_naming_the_variable_whatever_the_log_format(tmp_path: Path) -> None:
    env = env_for(tmp_path, NPC_BRIDGE_WORLD_TOKEN=TOKEN, NPC_BRIDGE_LLM_CONCURRENCY="lots")
    env["NPC_BRIDGE_LOG_FORMAT"] = "console"
    result = subprocess.run([*BRIDGE, "run"], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("npc-bridge: configuration error: NPC_BRIDGE_LLM_CONCURRENCY: ")
    assert TOKEN not in result.stderr + result.stdout


def test_invalid_character_file_stops_start_up_with_path_and_field(tmp_path: Path) -> None:
    characters = tmp_path / "characters"
    shutil.copytree(REPO / "characters", characters)
    (characters / "cafe-minori.json").write_text('{"id": "cafe-minori", "name": "x"}', encoding="utf-8")
    env = env_for(tmp_path, NPC_BRIDGE_WORLD_TOKEN=TOKEN, NPC_BRIDGE_CHARACTERS_DIR=str(characters))
    result = subprocess.run([*BRIDGE, "run"], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "cafe-minori.json" in result.stderr and "persona" in result.stderr


def test_check_with_the_example_env_and_the_credential_prints_a_clear_report(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    for line in (REPO / "systemd" / "npc-bridge.env.example").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    # As the unit's LoadCredential= hands it over.
    (tmp_path / "credentials").mkdir()
    (tmp_path / "credentials" / "world-token").write_text("change-me-credential\n", encoding="utf-8")
    env["CREDENTIALS_DIRECTORY"] = str(tmp_path / "credentials")
    # Nothing listens on these loopback ports: the report must say so, and exit 1.
    port = _free_port()
    env["NPC_BRIDGE_WORLD_URL"] = f"http://127.0.0.1:{port}"
    env["NPC_BRIDGE_LLM_URL"] = f"http://127.0.0.1:{port}"
    result = subprocess.run([*BRIDGE, "check"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    out = result.stdout
    assert "ok    configuration valid" in out
    assert "ok    world token present (not shown)" in out
    assert "voiced: cafe-minori, cinema-aoi, haruno, ryokan-fumi" in out
    assert f"FAIL  world http://127.0.0.1:{port} unreachable" in out
    assert "FAIL  LLM ollama" in out
    assert "change-me" not in out
    assert "is not a setting" not in out  # every name in the example is a real setting


async def test_check_passes_when_world_and_llm_answer(tmp_path: Path) -> None:
    async with FakeOllama() as llm:
        env = env_for(tmp_path, NPC_BRIDGE_WORLD_TOKEN=TOKEN, NPC_BRIDGE_LLM_URL=llm.url, NPC_BRIDGE_WORLD_URL=llm.url)
        proc = await asyncio.create_subprocess_exec(
            *BRIDGE, "check", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    assert "model elyza-jp-8b available" in out.decode()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- with a real world ---------------------------------------------------------------------------------


@pytest.mark.world
async def test_sigterm_shuts_down_gracefully_with_a_consented_leave(live_world: WorldServer, tmp_path: Path) -> None:
    notify = NotifyListener(tmp_path)
    async with FakeOllama() as llm:
        llm.default = "[happy]いらっしゃいませ！ゆっくりしていってくださいね。"
        env = env_for(
            tmp_path,
            NPC_BRIDGE_WORLD_URL=live_world.url,
            NPC_BRIDGE_WORLD_TOKEN=TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            **notify.env(watchdog_usec=2_000_000),
        )
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)
        try:
            await live_world.wait_for_worker(20)
            event_id = await live_world.inject_talk("cafe-minori", "player-1", "こんにちは")
            say = await live_world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=20)
            assert say["text"] == "いらっしゃいませ！ゆっくりしていってくださいね。"
            assert say["emotion"] == "happy" and say["source"] == "generated"
            await asyncio.sleep(1.2)  # let a watchdog ping or two go out
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    record = await live_world.record()
    assert [leave["consented"] for leave in record["leaves"]] == [True]
    assert record["drops"] == []
    notify.close()
    messages = notify.messages
    assert messages[0] == "READY=1"
    assert "STATUS=joined world" in messages or any(m.startswith("STATUS=joined") for m in messages)
    assert "WATCHDOG=1" in messages and "STOPPING=1" in messages
    events = [e["event"] for e in log_events(log_path)]
    assert "bridge_stopped" in events and "component_crashed" not in events
    assert TOKEN not in log_path.read_text(encoding="utf-8")


@pytest.mark.world
async def test_the_token_comes_from_the_systemd_credential(live_world: WorldServer, tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "world-token").write_text(TOKEN + "\n", encoding="utf-8")
    async with FakeOllama() as llm:
        env = env_for(tmp_path, NPC_BRIDGE_WORLD_URL=live_world.url, NPC_BRIDGE_LLM_URL=llm.url)
        env["CREDENTIALS_DIRECTORY"] = str(credentials)
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)
        try:
            record = await live_world.wait_for_worker(30)
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    assert record["authFailures"] == 0
    assert TOKEN not in log_path.read_text(encoding="utf-8")


@pytest.mark.world
async def test_wrong_token_is_logged_as_configuration_error_without_the_token(
    live_world: WorldServer, tmp_path: Path
) -> None:
    wrong = "wrong-token-77aa"
    async with FakeOllama() as llm:
        env = env_for(
            tmp_path, NPC_BRIDGE_WORLD_URL=live_world.url, NPC_BRIDGE_WORLD_TOKEN=wrong, NPC_BRIDGE_LLM_URL=llm.url
        )
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)
        try:
            await live_world.wait_for(lambda record: record["authFailures"] >= 1, 20)
            await asyncio.sleep(1.0)
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    text = log_path.read_text(encoding="utf-8")
    assert wrong not in text and TOKEN not in text
    events = [str(e["event"]) for e in log_events(log_path)]
    assert any("auth" in event for event in events)
    # Outside systemd every component still runs until shutdown: none ends and gets restarted.
    assert "component_returned" not in events and "component_crashed" not in events
    # Retried slowly, not in a loop.
    assert (await live_world.record())["authFailures"] <= 3


@pytest.mark.world
@pytest.mark.parametrize("stdout", ["broken pipe", "closed"])
async def test_the_daemon_keeps_answering_when_its_stdout_goes_away(
    live_world: WorldServer, tmp_path: Path, stdout: str
) -> None:
    async with FakeOllama() as llm:
        llm.default = "[happy]いらっしゃいませ！"
        env = env_for(
            tmp_path, NPC_BRIDGE_WORLD_URL=live_world.url, NPC_BRIDGE_WORLD_TOKEN=TOKEN, NPC_BRIDGE_LLM_URL=llm.url
        )
        err_path = tmp_path / "stderr.log"
        with err_path.open("wb") as err:
            if stdout == "broken pipe":
                # `npc-bridge run | head -1`: the reader takes one line and goes.
                proc = await asyncio.create_subprocess_exec(
                    *BRIDGE, "run", env=env, stdout=asyncio.subprocess.PIPE, stderr=err
                )
                assert proc.stdout is not None
                first = await asyncio.wait_for(proc.stdout.readline(), 30)
                assert b'"event": "bridge_starting"' in first
                proc._transport.get_pipe_transport(1).close()  # type: ignore[attr-defined]
            else:  # started with stdout closed (`npc-bridge run >&-`)
                proc = await asyncio.create_subprocess_exec(
                    "sh", "-c", 'exec "$@" >&-', "sh", *BRIDGE, "run", env=env, stderr=err
                )
        try:
            await live_world.wait_for_worker(30)
            for n in range(3):  # several replies, each with several log lines
                event_id = await live_world.inject_talk("cafe-minori", f"player-{n}", "こんにちは")
                say = await live_world.wait_for_say(lambda p, e=event_id: p["replyTo"] == e, timeout=30)
                assert say["text"] == "いらっしゃいませ！"
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    errors = err_path.read_text(encoding="utf-8")
    assert "Traceback" not in errors and "Exception" not in errors, errors
    reason = "stdout failed (BrokenPipeError: Broken pipe)" if stdout == "broken pipe" else "stdout is closed"
    reports = [line for line in errors.splitlines() if line.startswith(f"npc-bridge: {reason}: ")]
    assert reports, errors
    final = int(reports[-1].split(": ")[-1].split()[0])
    assert final > 10  # start-up, join, claim and three replies' worth of lines, counted
    assert errors.splitlines() == reports
