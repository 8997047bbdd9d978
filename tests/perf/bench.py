"""The benchmark: bridge overhead, time to say, prompt prefix reuse, footprint (issue 6); recall quality
(part 5, issue 12, tests/perf/recall_quality.py); the cast growing to 1,000 NPCs (part 6, issue 14,
tests/perf/scale.py); sentence by sentence (part 7, issue 13, tests/perf/parts.py). Prints tables, writes JSON.

    .venv/bin/python -m tests.perf.bench [--quick] [--part N ...] [--json out.json]

Not a test: nothing here asserts; every part prints its figures, the goal and PASS/MISS. See README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.perf import recall_quality
from tests.perf.parts import part7, print_part7
from tests.perf.scale import part6, print_part6
from tests.perf.support import (
    CLOCK_TICKS_PER_SECOND,
    REPO,
    STAFF,
    TOKEN,
    TOKENS_PER_SECOND,
    Daemon,
    Injector,
    LLMProcess,
    TimedOllama,
    Timing,
    bridge_env,
    cpu_percent,
    instant_answer,
    proc_sample,
    said_at_seconds,
    streamed_answer,
    streamed_plans,
    summary_ms,
    table,
    verdict,
    world_stamp_resolution,
    world_talk_stamps,
)
from tests.world.harness import Version, WorldServer, node_available

DEFAULT_JSON = REPO / "tests" / "perf" / "results" / "latest.json"
WORLD_VERSION: Version = "0.18"
LLM_CONCURRENCY = "3"

# Part 1 goal: p99 of each direction at 50 players.
OVERHEAD_P99_GOAL_MS = 5.0
# A line waited behind its NPC's previous line when the bridge logged more than this as queued_ms.
QUEUED_THRESHOLD_MS = 1.0
# Part 2 goal: say ≤ 1.05 × ideal + 20 ms.
SAY_FACTOR = 1.05
SAY_SLACK_SECONDS = 0.020
# Part 4 goals.
IDLE_CPU_GOAL_PERCENT = 1.0
RSS_GOAL_BYTES = 80 * 1024 * 1024
# "Flat": RSS grows by at most this much from the first tenth of the replies to the end.
RSS_FLAT_BYTES = 4 * 1024 * 1024
MIB = 1024 * 1024
# Part 3: a reply reuses the cached prefix when the server evaluates at most this share of its prompt.
REUSE_MAX_EVALUATED_SHARE = 0.2

PLAYER_LINES = (
    "こんにちは、今日のおすすめは何ですか",
    "ホットコーヒーをひとつお願いします",
    "ここは何時まで開いていますか",
    "おすすめの映画を教えてください",
    "温泉は何時から入れますか",
    "ありがとう、また来ます",
    "今日は雨が降りそうですね",
    "甘いものが食べたい気分です",
)


@dataclass(frozen=True)
class Level:
    players: int
    mean_interval_seconds: float  # each player's pace: one line every this ±50 %
    duration_seconds: float


@dataclass(frozen=True)
class Plan:
    levels: tuple[Level, ...]
    stream_samples: int
    llama_replies_same_npc: int
    idle_seconds: float
    replies: int
    replies_per_second: float


FULL = Plan(
    levels=(Level(1, 0.3, 40.0), Level(10, 2.0, 45.0), Level(50, 5.0, 50.0)),
    stream_samples=12,
    llama_replies_same_npc=4,
    idle_seconds=60.0,
    replies=1000,
    replies_per_second=40.0,
)
QUICK = Plan(
    levels=(Level(1, 0.3, 6.0), Level(10, 2.0, 8.0), Level(50, 5.0, 10.0)),
    stream_samples=3,
    llama_replies_same_npc=2,
    idle_seconds=10.0,
    replies=150,
    replies_per_second=40.0,
)


# ---- shared set-up ------------------------------------------------------------------------------------


class Bench:
    def __init__(
        self, plan: Plan, work: Path, *, profile: bool = False, external_llm: tuple[str, str] | None = None
    ) -> None:
        self.plan = plan
        self.profile = profile
        self.external_llm = external_llm  # (url, model): part 7's real half against it instead
        self.work = work
        self.rng = random.Random(6)
        self._seq = 0

    def next_event_id(self, level: int) -> str:
        self._seq += 1
        return f"ev{level:03d}-{self._seq:06d}"

    async def with_daemon(
        self,
        name: str,
        llm: TimedOllama | LLMProcess,
        body: Callable[[WorldServer, Daemon, Injector], Awaitable[dict[str, Any]]],
        say_parts: bool = False,
        extra_npcs: Sequence[str] = (),
        **env: str,
    ) -> dict[str, Any]:
        """A fresh world (offering say-parts, if asked; granting `extra_npcs` too) and daemon for one part."""
        world = await WorldServer.start(WORLD_VERSION, TOKEN, say_parts=say_parts, extra_npcs=extra_npcs)
        work = self.work / name
        work.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(
            bridge_env(work, world.url, llm.url, NPC_BRIDGE_LLM_CONCURRENCY=LLM_CONCURRENCY, **env),
            work / "bridge.log",
            profile_path=work / "bridge.prof" if self.profile else None,
        )
        injector = Injector(world)
        try:
            await daemon.start(world)
            result = await body(world, daemon, injector)
        finally:
            await injector.aclose()
            code = await daemon.stop()
            await world.stop()
        crashes = [e for e in daemon.events() if e.get("event") in ("component_crashed", "reply_crashed")]
        result["daemon_exit_code"] = code
        result["daemon_crashes"] = len(crashes)
        result["daemon_log"] = str(daemon.log_path)
        return result


# ---- part 1: overhead ---------------------------------------------------------------------------------


async def run_level(bench: Bench, level_no: int, level: Level, injector: Injector) -> list[str]:
    """Players talk at their pace for the level's duration; returns the event ids sent."""
    sent: list[str] = []
    stop_at = time.monotonic() + level.duration_seconds

    async def player(k: int) -> None:
        npc = STAFF[k % len(STAFF)]
        pid = f"pl{level_no}-{k}"
        await asyncio.sleep(bench.rng.uniform(0, level.mean_interval_seconds))
        while time.monotonic() < stop_at:
            event_id = bench.next_event_id(level_no)
            text = f"{bench.rng.choice(PLAYER_LINES)}（{event_id}）"
            await injector.talk(event_id, npc, pid, text, f"旅人{k}")
            sent.append(event_id)
            await asyncio.sleep(level.mean_interval_seconds * bench.rng.uniform(0.5, 1.5))

    # The benchmark's own collector stays off while it stamps: its pauses (gen 0/1 up to 3-4 ms, seen
    # with gc.callbacks) would delay the fake LLM's arrival stamps and be counted as the bridge's.
    gc.collect()
    gc.disable()
    try:
        await asyncio.gather(*(player(k) for k in range(level.players)))
    finally:
        gc.enable()
    return sent


def _reply_to(event_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda payload: bool(payload.get("replyTo") == event_id)


def iso_seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def part1(bench: Bench) -> dict[str, Any]:
    # The loopback LLM runs in its own process: see llm_process.py.
    async with LLMProcess() as llm:

        async def body(world: WorldServer, daemon: Daemon, injector: Injector) -> dict[str, Any]:
            # One warm-up line per NPC: first connections, first file writes.
            for npc in STAFF:
                event_id = bench.next_event_id(0)
                await injector.talk(event_id, npc, "warmup", f"こんにちは（{event_id}）", "旅人")
                await world.wait_for_say(_reply_to(event_id), 10)
            levels = []
            for number, level in enumerate(bench.plan.levels, start=1):
                print(f"  part 1: {level.players} players for {level.duration_seconds:.0f} s ...", flush=True)
                sent = await run_level(bench, number, level, injector)
                record = await wait_for_says(world, set(sent), 15.0)
                levels.append(overhead_figures(level, sent, record, await llm.first_by_tag(), daemon, injector))
            return {"levels": levels, "stamp_resolution": world_stamp_resolution(await world.record())}

        return await bench.with_daemon("part1", llm, body)


async def wait_for_says(world: WorldServer, ids: set[str], timeout_seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_seconds
    while True:
        record = await world.record()
        got = {e["payload"].get("replyTo") for e in record["said"]}
        if ids <= got or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.1)


def overhead_figures(
    level: Level,
    sent: list[str],
    record: dict[str, Any],
    timings: dict[str, Timing],
    daemon: Daemon,
    injector: Injector,
) -> dict[str, Any]:
    said = {e["payload"]["replyTo"]: e for e in record["said"]}
    talk_stamps = world_talk_stamps(record)
    events = daemon.events()
    queued_log = {e["event_id"]: e for e in events if e.get("event") == "talk_queued" and "event_id" in e}
    said_log = {e["event_id"]: e for e in events if e.get("event") == "reply_said" and "event_id" in e}
    inject_to_llm: list[float] = []
    inject_to_llm_unqueued: list[float] = []
    bridge_to_llm_unqueued: list[float] = []
    world_to_bridge: list[float] = []
    answer_to_say: list[float] = []
    queued_ms: list[float] = []
    slot_wait_ms: list[float] = []
    sources: dict[str, int] = {}
    tail: list[dict[str, Any]] = []
    missing = 0
    for event_id in sent:
        timing = timings.get(event_id)
        entry = said.get(event_id)
        log_said = said_log.get(event_id)
        if timing is None or entry is None or log_said is None:
            missing += 1
            continue
        sources[entry["payload"]["source"]] = sources.get(entry["payload"]["source"], 0) + 1
        # When the world sent the talk: its own stamp if it records one, else just before our POST
        # to its debug endpoint (an upper bound on the overhead: it adds the HTTP hop to the world).
        sent_at = talk_stamps.get(event_id, injector.posted[event_id][0])
        q_ms = float(log_said.get("queued_ms") or 0.0)
        queued_ms.append(q_ms)
        slot_wait_ms.append(float(log_said.get("slot_wait_ms") or 0.0))
        inject_to_llm.append(timing.arrived - sent_at)
        if q_ms <= QUEUED_THRESHOLD_MS:
            inject_to_llm_unqueued.append(timing.arrived - sent_at)
            logged = iso_seconds(queued_log[event_id]["timestamp"]) if event_id in queued_log else None
            tail.append(
                {
                    "event_id": event_id,
                    "sent_at": sent_at,
                    "inject_to_llm_ms": round((timing.arrived - sent_at) * 1000, 3),
                    "world_to_bridge_log_ms": None if logged is None else round((logged - sent_at) * 1000, 3),
                    "bridge_log_to_llm_ms": None if logged is None else round((timing.arrived - logged) * 1000, 3),
                }
            )
            if event_id in queued_log:
                bridge_to_llm_unqueued.append(timing.arrived - iso_seconds(queued_log[event_id]["timestamp"]))
        if event_id in queued_log:
            world_to_bridge.append(iso_seconds(queued_log[event_id]["timestamp"]) - sent_at)
        if timing.writes:
            answer_to_say.append(said_at_seconds(entry) - timing.writes[-1])
    queued = [q for q in queued_ms if q > QUEUED_THRESHOLD_MS]
    tail.sort(key=lambda sample: sample["inject_to_llm_ms"], reverse=True)
    return {
        "players": level.players,
        "pace_seconds": level.mean_interval_seconds,
        "duration_seconds": level.duration_seconds,
        "lines": len(sent),
        "unanswered": missing,
        "sources": sources,
        "inject_to_llm_all": summary_ms(inject_to_llm),
        "inject_to_llm_unqueued": summary_ms(inject_to_llm_unqueued),
        "world_to_bridge_log": summary_ms(world_to_bridge),
        "bridge_log_to_llm_unqueued": summary_ms(bridge_to_llm_unqueued),
        "answer_to_say": summary_ms(answer_to_say),
        "queued_lines": len(queued),
        "queued_ms": summary_ms([q / 1000 for q in queued_ms]),
        "slot_wait_ms": summary_ms([s / 1000 for s in slot_wait_ms]),
        "inject_stamp": "world record" if talk_stamps else "before POST /debug/talk (upper bound)",
        # The slowest unqueued lines, to read beside the daemon's log (work/part1/bridge.log).
        "slowest_inject_to_llm": tail[:10],
    }


def print_part1(result: dict[str, Any]) -> None:
    print("\n== Part 1: bridge overhead (instant loopback LLM, concurrency 3) ==")
    rows = []
    for lv in result["levels"]:
        for name, key in (
            ("inject → LLM (unqueued)", "inject_to_llm_unqueued"),
            ("inject → LLM (all)", "inject_to_llm_all"),
            ("  world → bridge log", "world_to_bridge_log"),
            ("  bridge log → LLM (unq.)", "bridge_log_to_llm_unqueued"),
            ("LLM answer → npc:say", "answer_to_say"),
            ("queued behind own NPC", "queued_ms"),
        ):
            s = lv[key]
            rows.append([lv["players"], name, s["n"], s["p50_ms"], s["p95_ms"], s["p99_ms"], s["max_ms"]])
    print(table(["players", "leg", "n", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows))
    for lv in result["levels"]:
        print(
            f"  {lv['players']:>2} players: {lv['lines']} lines, {lv['unanswered']} unanswered, "
            f"{lv['queued_lines']} queued > {QUEUED_THRESHOLD_MS} ms behind their NPC, sources {lv['sources']}"
        )
    print(f"  inject stamp: {result['levels'][0]['inject_stamp']}; world stamps: {result['stamp_resolution']}")
    top = result["levels"][-1]
    for name, key in (("inject → LLM", "inject_to_llm_unqueued"), ("LLM → npc:say", "answer_to_say")):
        p99 = top[key]["p99_ms"]
        ok = None if math.isnan(p99) else p99 <= OVERHEAD_P99_GOAL_MS
        result.setdefault("verdicts", {})[key] = verdict(ok)
        print(f"  goal {name} p99 ≤ {OVERHEAD_P99_GOAL_MS} ms at {top['players']} players: {p99} ms → {verdict(ok)}")


# ---- part 2: time to say ------------------------------------------------------------------------------



async def part2(bench: Bench) -> dict[str, Any]:
    delay = 1.0 / TOKENS_PER_SECOND
    plans = streamed_plans()
    async with TimedOllama(default=streamed_answer(plans), token_period_seconds=delay) as llm:

        async def body(world: WorldServer, daemon: Daemon, injector: Injector) -> dict[str, Any]:
            samples = []
            for index in range(bench.plan.stream_samples):
                npc = STAFF[index % len(STAFF)]
                event_id = bench.next_event_id(2)
                await injector.talk(event_id, npc, f"stream-{index}", f"こんにちは（{event_id}）", "旅人")
                entry_payload = await world.wait_for_say(_reply_to(event_id), 30)
                timings = llm.first_by_tag()
                timing = timings[event_id]
                assert timing.record is not None
                await timing.record.wait_ended(10)
                record = await world.record()
                entry = next(e for e in record["said"] if e["payload"]["replyTo"] == event_id)
                sample = stream_sample(npc, event_id, timing, entry, plans[npc][1], injector, entry_payload)
                sample.update(log_marks(daemon, event_id, timing.arrived))
                samples.append(sample)
            return {"samples": samples, "stamp_resolution": world_stamp_resolution(await world.record())}

        return await bench.with_daemon("part2", llm, body)


def log_marks(daemon: Daemon, event_id: str, arrived: float) -> dict[str, float]:
    """When the bridge logged its attempt (stream closed, text cleaned) and its say, from the LLM arrival."""
    marks = {}
    for event in daemon.events():
        if event.get("event_id") == event_id and event.get("event") in ("reply_attempt", "reply_said"):
            marks[f"{event['event']}_log_ms"] = round((iso_seconds(event["timestamp"]) - arrived) * 1000, 1)
    return marks



def stream_sample(
    npc: str,
    event_id: str,
    timing: Timing,
    entry: dict[str, Any],
    sentence_ends: list[int],
    injector: Injector,
    payload: dict[str, Any],
) -> dict[str, Any]:
    said = said_at_seconds(entry)
    arrived = timing.arrived
    ideal = timing.writes[sentence_ends[1]] - arrived
    last_token_index = sentence_ends[-1]
    if len(timing.writes) > last_token_index:
        naive = timing.writes[last_token_index] - arrived
    else:
        # The bridge closed the stream: when the last token would have gone out at the same pace.
        naive = ideal + (last_token_index - sentence_ends[1]) / TOKENS_PER_SECOND
    say = said - arrived
    record = timing.record
    assert record is not None
    bound = SAY_FACTOR * ideal + SAY_SLACK_SECONDS
    # The same on the fake's token schedule (token n due (n + 1) periods after arrival): what the
    # bridge does, without the benchmark process's own lateness in sending the next token.
    period = 1.0 / TOKENS_PER_SECOND
    next_token = sentence_ends[1] + 1
    share = (said - timing.writes[next_token]) if len(timing.writes) > next_token else math.nan
    scheduled_say = (next_token + 1) * period + share
    scheduled_bound = SAY_FACTOR * (sentence_ends[1] + 1) * period + SAY_SLACK_SECONDS
    return {
        "npc": npc,
        "event_id": event_id,
        "text": payload["text"],
        "source": payload["source"],
        "ideal_ms": round(ideal * 1000, 1),
        "say_ms": round(say * 1000, 1),
        "naive_ms": round(naive * 1000, 1),
        # The bridge's own share: from the token that completed the second sentence's end (the
        # first one after it) to the world receiving the say.
        "after_stop_token_ms": round(share * 1000, 1),
        "next_token_late_ms": (
            round((timing.writes[next_token] - arrived - (next_token + 1) * period) * 1000, 1)
            if len(timing.writes) > next_token
            else math.nan
        ),
        "scheduled_say_ms": round(scheduled_say * 1000, 1),
        "scheduled_bound_ms": round(scheduled_bound * 1000, 1),
        "ok_on_schedule": scheduled_say <= scheduled_bound,
        "inject_to_say_ms": round((said - injector.posted[event_id][0]) * 1000, 1),
        "bound_ms": round(bound * 1000, 1),
        "say_over_ideal": round(say / ideal, 3),
        "pieces_planned": record.pieces_planned,
        "pieces_sent": record.pieces_sent,
        "closed_early": record.closed_early,
        "token_ms": [round((w - arrived) * 1000, 1) for w in timing.writes],
        "ok": say <= bound,
    }


def print_part2(result: dict[str, Any]) -> None:
    print(f"\n== Part 2: time to say, 4 sentences streamed at {TOKENS_PER_SECOND:.0f} tokens/s (2 chars/token) ==")
    print("  times from the LLM request's arrival; ideal = 2nd sentence's last token sent, naive = last token sent")
    rows = [
        [
            s["npc"],
            s["ideal_ms"],
            s["say_ms"],
            s["naive_ms"],
            s["say_over_ideal"],
            s["after_stop_token_ms"],
            s["next_token_late_ms"],
            f"{s['pieces_sent']}/{s['pieces_planned']}",
            "yes" if s["closed_early"] else "NO",
            verdict(s["ok"]),
            verdict(s["ok_on_schedule"]),
        ]
        for s in result["samples"]
    ]
    print(
        table(
            [
                "npc",
                "ideal ms",
                "say ms",
                "naive ms",
                "say/ideal",
                "say − next token ms",
                "next token late ms",
                "tokens sent",
                "closed early",
                "goal",
                "on schedule",
            ],
            rows,
        )
    )
    samples = result["samples"]
    ok = all(s["ok"] for s in samples) if samples else None
    worst = max((s["say_ms"] - s["bound_ms"] for s in samples), default=math.nan)
    result["verdict"] = verdict(ok)
    result["worst_margin_ms"] = round(worst, 1)
    closed = sum(1 for s in samples if s["closed_early"])
    on_schedule = all(s["ok_on_schedule"] for s in samples) if samples else None
    result["verdict_on_schedule"] = verdict(on_schedule)
    shares = [s["after_stop_token_ms"] for s in samples]
    result["bridge_share_ms"] = summary_ms([v / 1000 for v in shares if not math.isnan(v)])
    print(f"  server saw the connection closed early: {closed}/{len(samples)}")
    print(
        "  the bridge's share (say − the token after the 2nd sentence): "
        f"p50 {result['bridge_share_ms']['p50_ms']} ms, max {result['bridge_share_ms']['max_ms']} ms"
    )
    print(f"  goal on the fake's token schedule (its own lateness taken out): {verdict(on_schedule)}")
    print(f"  said texts: {sorted({s['text'] for s in samples})}")
    print(
        f"  goal say ≤ {SAY_FACTOR} × ideal + {SAY_SLACK_SECONDS * 1000:.0f} ms for every sample: "
        f"worst say − bound = {worst:.1f} ms → {verdict(ok)}  (world stamps: {result['stamp_resolution']})"
    )


# ---- part 3: prompt prefix reuse (real llama.cpp) -----------------------------------------------------

LLAMA_LINES = (
    "こんにちは、今日のおすすめは何ですか",
    "じゃあ、それをひとつください",
    "甘いものも食べたいな",
    "ありがとう、また来ますね",
    "ここのお店は長いんですか",
    "雨が降ってきましたね",
)


async def part3(bench: Bench) -> dict[str, Any]:
    from tests.e2e.llama_server import LlamaServer, llama_available, prefix_hits

    reason = llama_available()
    if reason is not None:
        return {"skipped": reason}
    from bridge.llm.base import TEMPLATE_STOP_STRINGS, Done, GenerationRequest
    from bridge.llm.openai import OpenAIBackend
    from bridge.npc.characters import load_roster
    from bridge.npc.cleaner import clean
    from bridge.npc.prompt import Exchange, build_reply_messages
    from bridge.npc.responder import REPLY_MAX_TOKENS, REPLY_TEMPERATURE, TURN_STOP_STRINGS
    from bridge.npc.streaming import has_enough
    from bridge.settings import Settings

    settings = Settings()
    roster = load_roster(REPO / "characters")
    others_all = [c for c in roster.voiced.values()]
    replies: list[dict[str, Any]] = []
    server = LlamaServer(directory=REPO / ".e2e")
    print("  part 3: starting llama.cpp (llama-cpp-python) ...", flush=True)
    await asyncio.to_thread(server.start)
    try:
        backend = OpenAIBackend(server.url)
        try:
            plan = [("cafe-minori", i) for i in range(bench.plan.llama_replies_same_npc)] + [("cinema-aoi", 0)]
            histories: dict[str, list[Any]] = {}
            for npc_id, index in plan:
                character = roster.voiced[npc_id]
                history = histories.setdefault(npc_id, [])
                line = LLAMA_LINES[index % len(LLAMA_LINES)]
                messages = build_reply_messages(
                    character,
                    max_sentences=settings.reply_max_sentences,
                    world_lines=(),
                    memories=(),
                    history=history,
                    player_line=line,
                    context_tokens=2048,
                    max_reply_tokens=REPLY_MAX_TOKENS,
                )
                request = GenerationRequest(
                    messages=messages,
                    model=server.model_alias,
                    temperature=REPLY_TEMPERATURE,
                    max_tokens=REPLY_MAX_TOKENS,
                    deadline_seconds=120.0,
                    stop=(*TEMPLATE_STOP_STRINGS, *TURN_STOP_STRINGS),
                    kind="reply",
                )
                own = [character.name, character.short_name]
                others = [n for c in others_all if c.id != npc_id for n in (c.name, c.short_name)] + ["旅人"]
                since = len(server.log_text())
                began = time.monotonic()
                first: float | None = None
                raw = ""
                stopped_early = False
                prompt_tokens: int | None = None
                stream = backend.stream(request)
                try:
                    async for chunk in stream:
                        if isinstance(chunk, Done):
                            prompt_tokens = chunk.stats.prompt_eval_count
                            break
                        if first is None:
                            first = time.monotonic() - began
                        raw += chunk.text
                        if has_enough(raw, own_names=own, other_speakers=others, max_sentences=2):
                            stopped_early = True
                            break
                finally:
                    await stream.aclose()
                total = time.monotonic() - began
                log = await _server_counters(server, since)
                hits = prefix_hits(log)
                cleaned = clean(raw, own_names=own, other_speakers=others, max_sentences=2, max_chars=90)
                history.append(Exchange(player=line, npc=cleaned.text or raw[:60]))
                evaluated, reused = _evaluated(log, hits)
                if prompt_tokens is None and reused is not None and evaluated is not None:
                    prompt_tokens = reused + evaluated
                if prompt_tokens is None and len(messages) == 2:
                    # A first turn: nothing reused, no counters printed after an early close; count
                    # the Gemma 3 rendering of system + user (what the server evaluated) instead.
                    prompt_tokens = await _count_first_turn(server, messages[0].content, messages[1].content)
                if evaluated is None and not hits:
                    evaluated = prompt_tokens
                replies.append(
                    {
                        "npc": npc_id,
                        "turn": len(history),
                        "messages": len(messages),
                        "system_chars": len(messages[0].content),
                        "ttft_ms": round((first if first is not None else total) * 1000, 1),
                        "total_ms": round(total * 1000, 1),
                        "prompt_tokens": prompt_tokens
                        if prompt_tokens is not None
                        else (reused + evaluated if reused is not None and evaluated is not None else None),
                        "reused_tokens": reused,
                        "evaluated_tokens": evaluated,
                        "stopped_early": stopped_early,
                        "said": cleaned.text,
                    }
                )
                print(f"    {npc_id} turn {len(history)}: ttft {replies[-1]['ttft_ms']} ms", flush=True)
        finally:
            await backend.aclose()
    finally:
        await asyncio.to_thread(server.stop)
    return {
        "replies": replies,
        "server": "llama-cpp-python (tests/e2e/llama_server.py), Gemma 3 270M Q4_K_M",
        "log": str(server.log_path),
    }


async def _count_first_turn(server: Any, system: str, user: str) -> int | None:
    """Tokens of a system + user prompt as the server's Gemma 3 template renders it (with <bos>)."""
    import httpx

    prompt = f"<start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n"
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(f"{server.url}/extras/tokenize/count", json={"input": prompt})
        if response.status_code != 200:
            return None
        count = response.json().get("count")
        return count if isinstance(count, int) else None


async def _server_counters(server: Any, since: int, timeout_seconds: float = 10.0) -> str:
    """The server's log since `since`, once it printed the finished request's counters."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        log: str = server.log_text()[since:]
        if "prompt eval time" in log or time.monotonic() > deadline:
            return log
        await asyncio.sleep(0.1)


def _evaluated(log: str, hits: list[tuple[int, int]]) -> tuple[int | None, int | None]:
    """(tokens evaluated, tokens reused) for the request whose log is `log`."""
    import re

    if hits:
        reused, remaining = hits[-1]
        return remaining, reused
    # No prefix hit logged: the whole prompt was evaluated; llama.cpp's counters say how many.
    match = re.findall(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", log)
    return (int(match[-1]) if match else None), 0


def print_part3(result: dict[str, Any]) -> None:
    print("\n== Part 3: prompt prefix reuse, real llama.cpp (Gemma 3 270M, 2 threads) ==")
    if "skipped" in result:
        print(f"  SKIPPED: {result['skipped']}")
        result["verdict"] = "n/a"
        return
    rows = [
        [
            r["npc"],
            r["turn"],
            r["messages"],
            r["ttft_ms"],
            r["total_ms"],
            r["prompt_tokens"] if r["prompt_tokens"] is not None else "-",
            r["reused_tokens"] if r["reused_tokens"] is not None else "-",
            r["evaluated_tokens"] if r["evaluated_tokens"] is not None else "-",
        ]
        for r in result["replies"]
    ]
    print(table(["npc", "turn", "msgs", "ttft ms", "total ms", "prompt tok", "reused", "evaluated"], rows))
    replies = result["replies"]
    same = [r for r in replies if r["npc"] == replies[0]["npc"]]
    # Reused: the server evaluated at most a fifth of the prompt (the new turns), the rest came
    # from its KV cache.
    reused = [
        r["prompt_tokens"] is not None
        and r["evaluated_tokens"] is not None
        and r["evaluated_tokens"] <= r["prompt_tokens"] * REUSE_MAX_EVALUATED_SHARE
        for r in same[1:]
    ]
    ok = all(reused) if reused else None
    result["verdict"] = verdict(ok)
    print(
        f"  goal: every reply after the first to {same[0]['npc']} reuses the character prefix "
        f"(evaluates ≤ {REUSE_MAX_EVALUATED_SHARE:.0%} of its prompt) → {verdict(ok)}"
    )
    for r in replies:
        print(f"    {r['npc']} turn {r['turn']} said: {r['said']!r}")


# ---- part 4: footprint --------------------------------------------------------------------------------


async def part4(bench: Bench) -> dict[str, Any]:
    counter = [0]
    async with TimedOllama(default=instant_answer(counter), piece_chars=4) as llm:

        async def body(world: WorldServer, daemon: Daemon, injector: Injector) -> dict[str, Any]:
            record = await world.record()
            claimed = sorted({n for c in record["claims"] for n in c["npcIds"]})
            await asyncio.sleep(3.0)  # start-up work (model check, first claims) done
            print(f"  part 4: idle for {bench.plan.idle_seconds:.0f} s ...", flush=True)
            idle = [proc_sample(daemon.pid)]
            end = time.monotonic() + bench.plan.idle_seconds
            while time.monotonic() < end:
                await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
                idle.append(proc_sample(daemon.pid))
            idle_cpu = cpu_percent(idle[0], idle[-1])
            print(f"  part 4: {bench.plan.replies} replies ...", flush=True)
            before = proc_sample(daemon.pid)
            curve, busy_cpu, answered = await many_replies(bench, world, daemon, injector)
            busy_ticks = proc_sample(daemon.pid).cpu_ticks - before.cpu_ticks
            final = proc_sample(daemon.pid)
            return {
                "claimed": claimed,
                "idle_seconds": round(idle[-1].at - idle[0].at, 1),
                "idle_cpu_percent": round(idle_cpu, 3),
                "idle_cpu_ticks": idle[-1].cpu_ticks - idle[0].cpu_ticks,
                "idle_rss_mib": [round(s.rss_bytes / MIB, 1) for s in idle[:: max(1, len(idle) // 12)]],
                "idle_rss_max_mib": round(max(s.rss_bytes for s in idle) / MIB, 1),
                "replies_answered": answered,
                "replies_curve": curve,
                "busy_cpu_percent": round(busy_cpu, 1),
                "busy_cpu_ms_per_reply": round(busy_ticks * 1000 / CLOCK_TICKS_PER_SECOND / max(1, answered), 2),
                "final_rss_mib": round(final.rss_bytes / MIB, 1),
                "peak_rss_mib": round(final.hwm_bytes / MIB, 1),
                "llm_requests": len(llm.timings),
            }

        return await bench.with_daemon("part4", llm, body)


async def many_replies(
    bench: Bench, world: WorldServer, daemon: Daemon, injector: Injector
) -> tuple[list[dict[str, Any]], float, int]:
    """`plan.replies` lines from 30 players (10 per NPC) at a steady pace; RSS every 10 % of the replies."""
    total = bench.plan.replies
    players = 30
    interval = 1.0 / bench.plan.replies_per_second
    curve: list[dict[str, Any]] = []
    start = proc_sample(daemon.pid)
    curve.append({"said": 0, "rss_mib": round(start.rss_bytes / MIB, 1)})
    step = max(1, total // 10)
    next_mark = step
    sent = 0
    said = 0
    began = time.monotonic()
    while sent < total or said < total:
        if sent < total:
            k = sent % players
            event_id = bench.next_event_id(4)
            text = f"{PLAYER_LINES[sent % len(PLAYER_LINES)]}（{event_id}）"
            await injector.talk(event_id, STAFF[k % len(STAFF)], f"busy-{k}", text, f"旅人{k}")
            sent += 1
            await asyncio.sleep(max(0.0, began + sent * interval - time.monotonic()))
        if sent % 20 == 0 or sent >= total:
            said = len((await world.record())["said"])
            while said >= next_mark and next_mark <= total:
                sample = proc_sample(daemon.pid)
                curve.append({"said": next_mark, "rss_mib": round(sample.rss_bytes / MIB, 1)})
                next_mark += step
            if sent >= total:
                if time.monotonic() - began > 120:
                    break
                await asyncio.sleep(0.1)
    end = proc_sample(daemon.pid)
    return curve, cpu_percent(start, end), said


def print_part4(result: dict[str, Any]) -> None:
    print("\n== Part 4: footprint of the daemon ==")
    print(f"  NPCs claimed: {', '.join(result['claimed'])}")
    print(
        table(
            ["measure", "value", "goal", "verdict"],
            [
                [
                    f"idle CPU over {result['idle_seconds']:.0f} s (% of one core)",
                    result["idle_cpu_percent"],
                    f"< {IDLE_CPU_GOAL_PERCENT} %",
                    verdict(result["idle_cpu_percent"] < IDLE_CPU_GOAL_PERCENT),
                ],
                [
                    "idle RSS max (MiB)",
                    result["idle_rss_max_mib"],
                    "≤ 80 MiB",
                    verdict(result["idle_rss_max_mib"] * MIB <= RSS_GOAL_BYTES),
                ],
                [
                    f"RSS after {result['replies_answered']} replies (MiB)",
                    result["final_rss_mib"],
                    "≤ 80 MiB",
                    verdict(result["final_rss_mib"] * MIB <= RSS_GOAL_BYTES),
                ],
                [
                    "peak RSS, VmHWM (MiB)",
                    result["peak_rss_mib"],
                    "≤ 80 MiB",
                    verdict(result["peak_rss_mib"] * MIB <= RSS_GOAL_BYTES),
                ],
                [
                    "RSS growth 10 % → 100 % of replies (MiB)",
                    result["rss_growth_mib"],
                    f"≤ {RSS_FLAT_BYTES // MIB} MiB (flat)",
                    verdict(result["rss_growth_mib"] * MIB <= RSS_FLAT_BYTES),
                ],
                ["CPU while answering (% of one core)", result["busy_cpu_percent"], "-", "-"],
            ],
        )
    )
    print("  RSS along the replies: " + ", ".join(f"{p['said']}→{p['rss_mib']}" for p in result["replies_curve"]))
    print(f"  RSS slope after the first 10 %: {result['rss_kib_per_reply']} KiB per reply")
    print(f"  CPU per reply while answering: {result['busy_cpu_ms_per_reply']} ms")
    print("  idle RSS samples (MiB): " + ", ".join(str(v) for v in result["idle_rss_mib"]))


def finish_part4(result: dict[str, Any]) -> None:
    curve = result["replies_curve"]
    result["rss_growth_mib"] = round(curve[-1]["rss_mib"] - curve[1]["rss_mib"], 1) if len(curve) > 2 else math.nan
    replies = curve[-1]["said"] - curve[1]["said"] if len(curve) > 2 else 0
    result["rss_kib_per_reply"] = round(result["rss_growth_mib"] * 1024 / replies, 2) if replies else math.nan
    checks = [
        result["idle_cpu_percent"] < IDLE_CPU_GOAL_PERCENT,
        result["peak_rss_mib"] * MIB <= RSS_GOAL_BYTES,
        result["rss_growth_mib"] * MIB <= RSS_FLAT_BYTES,
    ]
    result["verdict"] = verdict(all(checks))


# ---- main ---------------------------------------------------------------------------------------------


def _loadavg() -> float:
    """The 1-minute load average: other work on the machine skews every figure here."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def machine() -> dict[str, Any]:
    def run(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "nproc": run("nproc"),
        "cpu": run("lscpu | grep -m1 'Model name' | sed 's/.*: *//'"),
        "python": platform.python_version(),
        "node": run("node --version"),
        "kernel": platform.release(),
    }


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples, 10 s idle: a smoke run")
    parser.add_argument("--part", type=int, action="append", choices=(1, 2, 3, 4, 5, 6, 7), help="run only these parts")
    parser.add_argument("--profile", action="store_true", help="run the daemon under cProfile (slower)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write results ({DEFAULT_JSON})")
    parser.add_argument(
        "--llm-url",
        help="part 7: time the real half against this OpenAI-compatible server (Ollama: http://host:11434) "
        "instead of the two small models",
    )
    parser.add_argument("--llm-model", help="with --llm-url: the model to ask for")
    args = parser.parse_args(argv)
    if bool(args.llm_url) != bool(args.llm_model):
        parser.error("--llm-url and --llm-model go together")
    parts = sorted(set(args.part or (1, 2, 3, 4, 5, 6, 7)))
    if not node_available() and set(parts) & {1, 2, 4, 6, 7}:
        print("node and npm are needed for the reference world (parts 1, 2, 4, 6 and 7)", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    results: dict[str, Any] = {
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
    }
    began = time.monotonic()
    # Daemon logs and memory files of this run, kept for a look afterwards (the folder is git-ignored).
    work = args.json.parent / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    external = (args.llm_url, args.llm_model) if args.llm_url else None
    bench = Bench(plan, work, profile=args.profile, external_llm=external)
    runners: dict[int, tuple[Callable[[Bench], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], None]]]
    runners = {1: (part1, print_part1), 2: (part2, print_part2), 3: (part3, print_part3), 4: (part4, print_part4)}
    runners[5] = (recall_quality.part, recall_quality.print_result)  # recall (issue 12): pure code, no world
    runners[6] = (lambda b: part6(b, idle_seconds=min(20.0, b.plan.idle_seconds)), print_part6)  # cast size (14)
    runners[7] = (part7, print_part7)  # sentence by sentence (13)
    for number in parts:
        run, show = runners[number]
        started = time.monotonic()
        load_before = _loadavg()
        result = await run(bench)
        result["loadavg_before_after"] = [load_before, _loadavg()]
        if number == 4:
            finish_part4(result)
        result["seconds"] = round(time.monotonic() - started, 1)
        show(result)
        print(f"  load average (1 min) before/after: {result['loadavg_before_after']}; {result['seconds']} s")
        results[f"part{number}"] = result
    results["seconds"] = round(time.monotonic() - began, 1)
    print(f"\nmachine: {results['machine']}; whole run {results['seconds']} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
