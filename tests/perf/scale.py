"""Issue 14's benchmark part: one bridge voicing N generated staff characters (part 6 of bench.py).

    .venv/bin/python -m tests.perf.bench --part 6 [--quick]
    .venv/bin/python -m tests.perf.scale [--sizes 3 30 300 1000] [--quick] [--json out.json]

For each N: a characters folder of N staff made from cafe-minori's file (ids `staff-0001` …, names
unique), a fresh reference world (0.18) that grants those ids, the instant loopback LLM of part 1,
and a fresh daemon. Measured: the time from the daemon's start until every id is claimed; CPU and RSS
while idle; `TALKS` lines spread over the NPCs (talk i goes to NPC i mod N, from one of `PLAYERS`
players), sent at a steady pace: CPU per reply, inject → say percentiles, RSS after them. Then the
growth per NPC between the smallest and the largest N that was claimed.

Goals (issue 14): CPU per reply at 1,000 NPCs within 1.5× of the figure at 30; RSS after the talks at
1,000 NPCs under 80 MiB. Nothing here asserts: it prints figures and PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tests.perf.support import (
    CLOCK_TICKS_PER_SECOND,
    REPO,
    TOKEN,
    Daemon,
    Injector,
    LLMProcess,
    bridge_env,
    cpu_percent,
    proc_sample,
    said_at_seconds,
    summary_ms,
    table,
    verdict,
    world_talk_stamps,
)
from tests.world.harness import Version, WorldServer

SIZES = (3, 30, 300, 1000)
TALKS = 200
PLAYERS = 50
TALKS_PER_SECOND = 20.0
WORLD_VERSION: Version = "0.18"
CLAIM_TIMEOUT_SECONDS = 60.0
SAY_TIMEOUT_SECONDS = 60.0
# Goals (issue 14).
CPU_FACTOR_GOAL = 1.5  # CPU per reply at the largest N against the figure at 30
RSS_AFTER_GOAL_MIB = 80.0
MIB = 1024 * 1024
LINES = ("こんにちは、今日のおすすめは何ですか", "ここは何時まで開いていますか", "ありがとう、また来ます")


class BenchLike(Protocol):
    work: Path

    def next_event_id(self, level: int) -> str: ...


def npc_ids(count: int) -> list[str]:
    return [f"staff-{n:04d}" for n in range(1, count + 1)]


def write_characters(directory: Path, count: int) -> list[str]:
    """`count` staff files made from cafe-minori's, each with its own id, name and speaker name."""
    directory.mkdir(parents=True, exist_ok=True)
    template = json.loads((REPO / "characters" / "cafe-minori.json").read_text(encoding="utf-8"))
    ids = npc_ids(count)
    for number, npc_id in enumerate(ids, start=1):
        data = {**template, "id": npc_id, "name": f"お店の店員{number}号", "speaker_name": f"店員{number}"}
        (directory / f"{npc_id}.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return ids


async def claimed_ids(world: WorldServer) -> set[str]:
    record = await world.record()
    return {npc_id for claim in record["claims"] for npc_id in claim["npcIds"]}


async def one_size(bench: BenchLike, llm: LLMProcess, size: int, idle_seconds: float) -> dict[str, Any]:
    work = bench.work / f"scale-{size}"
    shutil.rmtree(work, ignore_errors=True)  # memory files of an earlier run would be extracted at start
    ids = write_characters(work / "generated", size)
    world = await WorldServer.start(WORLD_VERSION, TOKEN, extra_npcs=ids)
    env = bridge_env(work, world.url, llm.url, NPC_BRIDGE_CHARACTERS_DIR=str(work / "generated"))
    profile = work / "bridge.prof" if getattr(bench, "profile", False) else None
    daemon = Daemon(env, work / "bridge.log", profile_path=profile)
    injector = Injector(world)
    result: dict[str, Any] = {"npcs": size}
    try:
        began = time.monotonic()
        try:
            await daemon.start(world, CLAIM_TIMEOUT_SECONDS)
        except TimeoutError:
            pass  # no claim at all: reported below as claimed 0
        claimed: set[str] = set()
        while time.monotonic() - began < CLAIM_TIMEOUT_SECONDS:
            claimed = await claimed_ids(world) & set(ids)
            if len(claimed) == size:
                break
            await asyncio.sleep(0.05)
        result["claimed"] = len(claimed)
        result["claim_seconds"] = round(time.monotonic() - began, 2) if len(claimed) == size else math.nan
        if len(claimed) < size:
            result["disconnects"] = sum(1 for e in daemon.events() if e.get("event") == "world_disconnected")
            return result
        await asyncio.sleep(2.0)  # start-up work done (model check, first claims)
        idle = [proc_sample(daemon.pid)]
        end = time.monotonic() + idle_seconds
        while time.monotonic() < end:
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
            idle.append(proc_sample(daemon.pid))
        result["idle_cpu_percent"] = round(cpu_percent(idle[0], idle[-1]), 3)
        result["idle_rss_mib"] = round(max(s.rss_bytes for s in idle) / MIB, 1)
        result.update(await talks(bench, world, daemon, injector, ids))
    finally:
        await injector.aclose()
        result["daemon_exit_code"] = await daemon.stop()
        await world.stop()
    result["daemon_crashes"] = sum(
        1 for e in daemon.events() if e.get("event") in ("component_crashed", "reply_crashed")
    )
    return result


async def talks(
    bench: BenchLike, world: WorldServer, daemon: Daemon, injector: Injector, ids: list[str]
) -> dict[str, Any]:
    """`TALKS` lines at a steady pace, talk i to NPC i mod N; then wait for every say."""
    before = proc_sample(daemon.pid)
    sent: list[str] = []
    began = time.monotonic()
    for number in range(TALKS):
        event_id = bench.next_event_id(5)
        player = number % PLAYERS
        text = f"{LINES[number % len(LINES)]}（{event_id}）"
        await injector.talk(event_id, ids[number % len(ids)], f"scale-{player}", text, f"旅人{player}")
        sent.append(event_id)
        await asyncio.sleep(max(0.0, began + (number + 1) / TALKS_PER_SECOND - time.monotonic()))
    deadline = time.monotonic() + SAY_TIMEOUT_SECONDS
    while True:
        record = await world.record()
        said = {e["payload"].get("replyTo"): e for e in record["said"]}
        if set(sent) <= said.keys() or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    after = proc_sample(daemon.pid)
    stamps = world_talk_stamps(record)
    waits = [
        said_at_seconds(said[event_id]) - stamps.get(event_id, injector.posted[event_id][0])
        for event_id in sent
        if event_id in said
    ]
    sources: dict[str, int] = {}
    for event_id in sent:
        if event_id in said:
            source = said[event_id]["payload"].get("source", "?")
            sources[source] = sources.get(source, 0) + 1
    answered = len(waits)
    cpu_ms = (after.cpu_ticks - before.cpu_ticks) * 1000 / CLOCK_TICKS_PER_SECOND
    return {
        "talks": len(sent),
        "answered": answered,
        "sources": sources,
        "rss_after_mib": round(after.rss_bytes / MIB, 1),
        "peak_rss_mib": round(after.hwm_bytes / MIB, 1),
        "cpu_ms_per_reply": round(cpu_ms / max(1, answered), 2),
        "inject_to_say": summary_ms(waits),
    }


async def part6(bench: BenchLike, sizes: tuple[int, ...] = SIZES, idle_seconds: float = 20.0) -> dict[str, Any]:
    runs = []
    async with LLMProcess() as llm:
        for size in sizes:
            print(f"  part 6: {size} NPCs ...", flush=True)
            runs.append(await one_size(bench, llm, size, idle_seconds))
    result: dict[str, Any] = {"runs": runs, "talks": TALKS, "players": PLAYERS, "talks_per_second": TALKS_PER_SECOND}
    result.update(growth(runs))
    return result


def growth(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per NPC, between the smallest and the largest N that was claimed and answered; and the goals."""
    done = [run for run in runs if run.get("answered")]
    out: dict[str, Any] = {}
    if len(done) >= 2:
        low, high = done[0], done[-1]
        extra = high["npcs"] - low["npcs"]
        out["growth_per_npc"] = {
            "between": [low["npcs"], high["npcs"]],
            "claim_ms": round((high["claim_seconds"] - low["claim_seconds"]) * 1000 / extra, 3),
            "idle_rss_kib": round((high["idle_rss_mib"] - low["idle_rss_mib"]) * 1024 / extra, 2),
            "rss_after_kib": round((high["rss_after_mib"] - low["rss_after_mib"]) * 1024 / extra, 2),
            "cpu_us_per_reply": round((high["cpu_ms_per_reply"] - low["cpu_ms_per_reply"]) * 1000 / extra, 3),
            "idle_cpu_percent": round((high["idle_cpu_percent"] - low["idle_cpu_percent"]) / extra, 5),
        }
    by_size = {run["npcs"]: run for run in done}
    base, top = by_size.get(30), by_size.get(1000)
    out["cpu_goal"] = (
        None if base is None or top is None else top["cpu_ms_per_reply"] <= CPU_FACTOR_GOAL * base["cpu_ms_per_reply"]
    )
    out["rss_goal"] = None if top is None else top["rss_after_mib"] < RSS_AFTER_GOAL_MIB
    claimed_all = all(run["claimed"] == run["npcs"] for run in runs)
    out["verdict"] = verdict(claimed_all and out["cpu_goal"] is not False and out["rss_goal"] is not False)
    return out


def print_part6(result: dict[str, Any]) -> None:
    print(f"\n== Part 6: one bridge, N staff NPCs ({result['talks']} talks, {result['players']} players) ==")
    rows = []
    for run in result["runs"]:
        say = run.get("inject_to_say", {})
        rows.append(
            [
                run["npcs"],
                f"{run['claimed']}/{run['npcs']}",
                run.get("claim_seconds", math.nan),
                run.get("idle_cpu_percent", math.nan),
                run.get("idle_rss_mib", math.nan),
                run.get("rss_after_mib", math.nan),
                run.get("cpu_ms_per_reply", math.nan),
                say.get("p50_ms", math.nan),
                say.get("p95_ms", math.nan),
                say.get("p99_ms", math.nan),
                ",".join(f"{k}:{v}" for k, v in run.get("sources", {}).items()) or "-",
            ]
        )
    headers = ["N", "claimed", "claim s", "idle CPU %", "idle RSS MiB", "RSS after MiB", "CPU ms/reply"]
    print(table([*headers, "say p50 ms", "p95 ms", "p99 ms", "sources"], rows))
    per = result.get("growth_per_npc")
    if per:
        print(
            f"  growth per NPC ({per['between'][0]} → {per['between'][1]}): claim {per['claim_ms']} ms, "
            f"idle RSS {per['idle_rss_kib']} KiB, RSS after talks {per['rss_after_kib']} KiB, "
            f"CPU per reply {per['cpu_us_per_reply']} µs, idle CPU {per['idle_cpu_percent']} %"
        )
    print(
        f"  goals: CPU per reply at 1,000 ≤ {CPU_FACTOR_GOAL}× at 30: {verdict(result['cpu_goal'])}; "
        f"RSS after talks at 1,000 < {RSS_AFTER_GOAL_MIB:.0f} MiB: {verdict(result['rss_goal'])}; "
        f"every NPC claimed at every N: {verdict(all(r['claimed'] == r['npcs'] for r in result['runs']))}"
    )


async def main(argv: list[str] | None = None) -> int:
    from tests.perf.bench import FULL, QUICK, Bench

    parser = argparse.ArgumentParser(prog="python -m tests.perf.scale", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="numbers of NPCs")
    parser.add_argument("--quick", action="store_true", help="5 s idle instead of 20 s")
    parser.add_argument("--profile", action="store_true", help="daemons under cProfile (bridge.prof)")
    parser.add_argument("--json", type=Path, default=REPO / "tests" / "perf" / "results" / "scale.json")
    args = parser.parse_args(argv)
    work = args.json.parent / "work-scale"
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(QUICK if args.quick else FULL, work, profile=args.profile)
    result = await part6(bench, tuple(args.sizes), idle_seconds=5.0 if args.quick else 20.0)
    print_part6(result)
    args.json.write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
