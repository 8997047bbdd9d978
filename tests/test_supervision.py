"""Supervision: a crash forced into each component of a real daemon (bridge/faults.py) against a real
world — it recovers, or, crashing again and again, ends the process with exit code 1 for systemd."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from bridge.supervisor import Supervisor
from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import (
    NotifyListener,
    bridge_env,
    force_crash,
    log_events,
    read_log,
    start_bridge,
    stop_bridge,
    wait_for_log,
)
from tests.fakes.llm_servers import FakeOllama
from tests.world.harness import WorldServer

REPLY = "いらっしゃいませ！ゆっくりしていってくださいね。"


async def test_a_crashing_component_is_restarted_with_growing_delays() -> None:
    runs: list[float] = []

    async def flaky() -> None:
        runs.append(asyncio.get_running_loop().time())
        raise RuntimeError("boom")

    supervisor = Supervisor(first_delay=0.05, cap=0.2, max_crashes=1000)
    task = asyncio.create_task(supervisor.supervise("flaky", flaky))
    await asyncio.sleep(0.6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert 3 <= len(runs) <= 12
    assert all(gap >= 0.02 for gap in gaps)  # never a tight loop
    assert max(gaps) > min(gaps)  # the delay grows


async def test_a_component_crashing_again_and_again_is_given_up_and_reported() -> None:
    given_up: list[tuple[str, int]] = []
    supervisor = Supervisor(
        first_delay=0.01, cap=0.01, max_crashes=5, window_seconds=60, on_give_up=lambda n, c: given_up.append((n, c))
    )

    async def broken() -> None:
        raise RuntimeError("boom")

    async def fine() -> None:
        await asyncio.Event().wait()

    healthy = asyncio.create_task(supervisor.supervise("fine", fine))
    await asyncio.wait_for(supervisor.supervise("broken", broken), 5)  # returns: not restarted again
    assert given_up == [("broken", 5)]
    assert not supervisor.all_running() and supervisor.restarting() == ["broken"]
    healthy.cancel()


async def test_crashes_outside_the_window_are_forgiven() -> None:
    now = [0.0]
    given_up: list[str] = []
    supervisor = Supervisor(
        first_delay=0.001,
        cap=0.001,
        max_crashes=3,
        window_seconds=10,
        clock=lambda: now[0],
        on_give_up=lambda n, c: given_up.append(n),
    )
    runs = 0
    eighth_run = asyncio.Event()

    async def crashes_every_six_seconds() -> None:
        nonlocal runs
        runs += 1
        now[0] += 6.0
        if runs >= 8:
            eighth_run.set()
            await asyncio.Event().wait()
        raise RuntimeError("boom")

    task = asyncio.create_task(supervisor.supervise("slow", crashes_every_six_seconds))
    await asyncio.wait_for(eighth_run.wait(), 5)
    assert given_up == [] and supervisor.all_running()
    task.cancel()


# ---- the daemon, a real world ----------------------------------------------------------------------


async def _talk_and_hear(world: WorldServer, player: str) -> None:
    event_id = await world.inject_talk("cafe-minori", player, "こんにちは")
    say = await world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=30)
    assert say["text"] == REPLY and say["source"] == "generated"


@pytest.mark.world
@pytest.mark.parametrize("component", ["world", "events", "replies", "memory", "watchdog"])
async def test_a_crash_forced_into_a_component_is_recovered_from(
    live_world: WorldServer, tmp_path: Path, component: str
) -> None:
    notify = NotifyListener(tmp_path)
    faults = tmp_path / "faults"
    async with FakeOllama(default=f"[happy]{REPLY}") as llm:
        env = bridge_env(
            tmp_path / "memory",
            NPC_BRIDGE_WORLD_URL=live_world.url,
            NPC_BRIDGE_WORLD_TOKEN=LIVE_WORLD_TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            NPC_BRIDGE_TEST_FAULTS=str(faults),
            **notify.env(watchdog_usec=1_000_000),
        )
        log_path = tmp_path / "bridge.log"
        proc = await start_bridge(env, log_path)
        try:
            await live_world.wait_for_worker(30)
            await _talk_and_hear(live_world, "player-1")
            await notify.wait_for(lambda m: m == "WATCHDOG=1")
            force_crash(faults, component)
            await wait_for_log(
                log_path, lambda e: e["event"] == "component_crashed" and e["component"] == component, proc=proc
            )
            restarting = await notify.wait_for(lambda m: m.startswith(f"STATUS=restarting {component}"))
            assert "after a crash (1 of 5 allowed in 5 min)" in restarting
            # Back: the status leaves "restarting", the watchdog pings again, and the NPC talks.
            await notify.wait_for(lambda m: m.startswith("STATUS=") and "restarting" not in m)
            await notify.wait_for(lambda m: m == "WATCHDOG=1")
            if component == "world":
                record = await live_world.wait_for(lambda r: len(r["claims"]) >= 2, 30)
                assert record["claims"][-1]["npcIds"] == record["claims"][0]["npcIds"]
            await _talk_and_hear(live_world, "player-2")
            assert await stop_bridge(proc) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
            notify.close()
    messages = notify.messages
    down = max(i for i, m in enumerate(messages) if m == restarting)
    up = next(
        i for i in range(down, len(messages)) if messages[i].startswith("STATUS=") and "restarting" not in messages[i]
    )
    # While the component was down, the watchdog was not told all is well.
    assert "WATCHDOG=1" not in messages[down:up]
    events = log_events(log_path)
    assert [e["component"] for e in events if e["event"] == "component_crashed"] == [component]
    assert "component_failed" not in [e["event"] for e in events]


@pytest.mark.world
async def test_a_component_crashing_five_times_ends_the_daemon_with_exit_1(
    live_world: WorldServer, tmp_path: Path
) -> None:
    notify = NotifyListener(tmp_path)
    faults = tmp_path / "faults"
    async with FakeOllama(default=f"[happy]{REPLY}") as llm:
        env = bridge_env(
            tmp_path / "memory",
            NPC_BRIDGE_WORLD_URL=live_world.url,
            NPC_BRIDGE_WORLD_TOKEN=LIVE_WORLD_TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            NPC_BRIDGE_TEST_FAULTS=str(faults),
            **notify.env(),
        )
        log_path = tmp_path / "bridge.log"
        err_path = tmp_path / "stderr.log"
        with log_path.open("ab") as out, err_path.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(*_bridge_run(), env=env, stdout=out, stderr=err)
        try:
            await live_world.wait_for_worker(30)
            force_crash(faults, "replies", times=5)
            # Backoff 0.5-1, 1-2, 2-4, 4-8 s between the five crashes.
            assert await asyncio.wait_for(proc.wait(), 90) == 1
        finally:
            if proc.returncode is None:
                proc.kill()
            notify.close()
    assert err_path.read_text(encoding="utf-8").splitlines() == [
        "npc-bridge: component replies crashed 5 times in 300 s; exiting so that systemd restarts the bridge"
    ]
    events = log_events(log_path)
    assert len([e for e in events if e["event"] == "component_crashed"]) == 5
    assert any(e["event"] == "component_failed" and e["component"] == "replies" for e in events)
    messages = notify.messages
    assert "STATUS=restarting replies after a crash (4 of 5 allowed in 5 min)" in messages
    statuses = [m for m in messages if m.startswith("STATUS=")]
    assert statuses[-1].startswith("STATUS=shutting down: component replies crashed 5 times")
    assert "STOPPING=1" in messages
    # It still left the room with consent on its way out.
    assert [leave["consented"] for leave in (await live_world.record())["leaves"]] == [True], read_log(log_path)


def _bridge_run() -> tuple[str, ...]:
    from tests.daemon import BRIDGE

    return (*BRIDGE, "run")
