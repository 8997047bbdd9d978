"""Benchmark part 7 (issue 13): sentence by sentence — when the world has part 0, when the whole line.

    .venv/bin/python -m tests.perf.bench --part 7 [--quick]

Both halves run the real daemon against a reference world (Colyseus 0.18) that offers `say-parts`;
the world stamps each `npc:say:part` and `npc:say` on arrival.

- Streamed fake: four sentences (an emotion tag first) at 20 tokens/s of 2 characters, each sentence
  starting a new token, on a fixed schedule from the request's arrival (as in part 2). From the
  request's arrival at the fake: when the first sentence's last token was sent, when the token that
  makes it final was sent (the next one: only it shows that no closing bracket follows), when part 0
  reached the world, when the final `npc:say` did. Goal: part 0 within 5 ms of that token.
- Real model: llama.cpp (llama-cpp-python) with Gemma 3 270M (`tests/e2e/llama_server.py`), the daemon
  on the OpenAI backend. From the talk's injection at the world: part 0 and the final `npc:say` at the
  world, and the bridge's own `first_part_ms` (LLM request → part 0 sent). Goal: median of part 0 /
  final line ≤ 0.6 over the replies said in two or more parts.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import TYPE_CHECKING, Any

from tests.perf.support import (
    REPO,
    STAFF,
    TOKENS_PER_SECOND,
    Daemon,
    Injector,
    TimedOllama,
    Timing,
    said_at_seconds,
    streamed_answer,
    streamed_plans,
    table,
    verdict,
)
from tests.world.harness import WorldServer

if TYPE_CHECKING:
    from tests.perf.bench import Bench

PART0_SLACK_MS = 5.0
REAL_RATIO_GOAL = 0.6
REAL_REPLIES_FULL = 12
REAL_REPLIES_QUICK = 4
# The llama.cpp server finishes a closed request up to the reply's 120 tokens before the next one.
SERVER_SETTLE_SECONDS = 8.0

REAL_LINES = (
    "こんにちは、今日のおすすめは何ですか",
    "じゃあ、それをひとつください",
    "甘いものも食べたいな",
    "ありがとう、また来ますね",
    "ここのお店は長いんですか",
    "雨が降ってきましたね",
)


async def part7(bench: Bench) -> dict[str, Any]:
    return {"streamed": await _streamed(bench), "real": await _real(bench)}


# ---- the streamed fake ---------------------------------------------------------------------------------


async def _streamed(bench: Bench) -> dict[str, Any]:
    plans = streamed_plans()
    async with TimedOllama(default=streamed_answer(plans), token_period_seconds=1.0 / TOKENS_PER_SECOND) as llm:

        async def body(world: WorldServer, daemon: Daemon, injector: Injector) -> dict[str, Any]:
            samples = []
            for index in range(bench.plan.stream_samples):
                npc = STAFF[index % len(STAFF)]
                event_id = bench.next_event_id(5)
                await injector.talk(event_id, npc, f"parts-{index}", f"こんにちは（{event_id}）", "旅人")
                await world.wait_for_say(lambda p, e=event_id: p["replyTo"] == e, 30)
                timing = llm.first_by_tag()[event_id]
                assert timing.record is not None
                await timing.record.wait_ended(10)
                samples.append(_streamed_sample(npc, event_id, timing, await world.record(), plans[npc][1]))
            return {"samples": samples, "violations": await world.violations()}

        return await bench.with_daemon("part7", llm, body, say_parts=True)


def _arrivals(record: dict[str, Any], event_id: str) -> tuple[list[float], float | None]:
    """When each part and the say of one reply reached the world (wall clock, seconds)."""
    parts = [said_at_seconds(e) for e in record["parts"] if e["payload"]["replyTo"] == event_id]
    says = [said_at_seconds(e) for e in record["said"] if e["payload"]["replyTo"] == event_id]
    return parts, (says[0] if says else None)


def _streamed_sample(
    npc: str, event_id: str, timing: Timing, record: dict[str, Any], sentence_ends: list[int]
) -> dict[str, Any]:
    arrived = timing.arrived
    parts, say = _arrivals(record, event_id)
    first_end = sentence_ends[0]

    def sent_ms(index: int) -> float:
        return round((timing.writes[index] - arrived) * 1000, 1) if len(timing.writes) > index else math.nan

    part0 = round((parts[0] - arrived) * 1000, 1) if parts else math.nan
    final_token = sent_ms(first_end + 1)
    return {
        "npc": npc,
        "event_id": event_id,
        "first_sentence_last_token_ms": sent_ms(first_end),
        "final_token_ms": final_token,
        "part0_ms": part0,
        "part0_after_final_token_ms": round(part0 - final_token, 1),
        "say_ms": round((say - arrived) * 1000, 1) if say is not None else math.nan,
        "parts": len(parts),
        "ok": part0 - final_token <= PART0_SLACK_MS,
    }


# ---- the real model ------------------------------------------------------------------------------------


async def _real(bench: Bench) -> dict[str, Any]:
    from tests.e2e.llama_server import LlamaServer, llama_available

    reason = llama_available()
    if reason is not None:
        return {"skipped": reason}
    server = LlamaServer(directory=REPO / ".e2e")
    print("  part 7: starting llama.cpp (llama-cpp-python) ...", flush=True)
    await asyncio.to_thread(server.start)
    count = REAL_REPLIES_QUICK if bench.plan.stream_samples <= 3 else REAL_REPLIES_FULL
    try:

        async def body(world: WorldServer, daemon: Daemon, injector: Injector) -> dict[str, Any]:
            samples = []
            for index in range(count):
                npc = STAFF[index % len(STAFF)]
                event_id = bench.next_event_id(5)
                await injector.talk(event_id, npc, f"real-{index}", REAL_LINES[index % len(REAL_LINES)], "旅人")
                await world.wait_for_say(lambda p, e=event_id: p["replyTo"] == e, 180)
                # This server finishes a generation the bridge closed: wait for it, or the next
                # line would wait for it too, on both part 0 and the say.
                await _server_idle()
                parts, say = _arrivals(await world.record(), event_id)
                injected = injector.posted[event_id][0]
                logged = next(
                    (e for e in daemon.events() if e.get("event") == "reply_said" and e.get("event_id") == event_id),
                    {},
                )
                samples.append(
                    {
                        "npc": npc,
                        "parts": len(parts),
                        "source": logged.get("source"),
                        "part0_ms": round((parts[0] - injected) * 1000, 1) if parts else math.nan,
                        "say_ms": round((say - injected) * 1000, 1) if say is not None else math.nan,
                        "first_part_ms_logged": logged.get("first_part_ms"),
                        "ratio": round((parts[0] - injected) / (say - injected), 3)
                        if parts and say is not None
                        else math.nan,
                    }
                )
            return {"samples": samples, "violations": await world.violations()}

        return await bench.with_daemon(
            "part7-real",
            server,  # only its url is used
            body,
            say_parts=True,
            NPC_BRIDGE_LLM_BACKEND="openai",
            NPC_BRIDGE_LLM_MODEL=server.model_alias,
            NPC_BRIDGE_LLM_CONTEXT_TOKENS="2048",
            NPC_BRIDGE_REPLY_DEADLINE_SECONDS="120",
            NPC_BRIDGE_MEMORY_SILENCE_SECONDS="3600",
        )
    finally:
        await asyncio.to_thread(server.stop)


async def _server_idle() -> None:
    """Give the llama.cpp server time to finish a generation the bridge closed (it keeps going to the
    reply's token limit, and logs nothing while it does): a fixed pause, ample for 120 tokens."""
    await asyncio.sleep(SERVER_SETTLE_SECONDS)


# ---- printing ------------------------------------------------------------------------------------------


def print_part7(result: dict[str, Any]) -> None:
    streamed = result["streamed"]
    print(f"\n== Part 7: sentence by sentence, 4 sentences streamed at {TOKENS_PER_SECOND:.0f} tokens/s ==")
    print("  times from the LLM request's arrival at the fake; 'final token' = the token after the 1st sentence")
    rows = [
        [
            s["npc"],
            s["first_sentence_last_token_ms"],
            s["final_token_ms"],
            s["part0_ms"],
            s["part0_after_final_token_ms"],
            s["say_ms"],
            s["parts"],
            verdict(s["ok"]),
        ]
        for s in streamed["samples"]
    ]
    headers = ["npc", "1st sentence token ms", "final token ms", "part 0 ms", "part 0 − final token", "say ms"]
    print(table([*headers, "parts", "goal"], rows))
    shares = [s["part0_after_final_token_ms"] for s in streamed["samples"]]
    ok = all(s["ok"] for s in streamed["samples"]) if shares else None
    streamed["verdict"] = verdict(ok)
    streamed["worst_ms"] = max(shares, default=math.nan)
    print(
        f"  goal part 0 ≤ final token + {PART0_SLACK_MS:.0f} ms: worst {streamed['worst_ms']} ms, "
        f"median {statistics.median(shares) if shares else math.nan} ms → {verdict(ok)}; "
        f"world rule violations: {len(streamed['violations'])}"
    )
    real = result["real"]
    if "skipped" in real:
        print(f"  real model: SKIPPED ({real['skipped']})")
        return
    print("\n  real model (Gemma 3 270M, llama.cpp): times from the talk's injection at the world")
    rows = [
        [s["npc"], s["source"], s["parts"], s["part0_ms"], s["first_part_ms_logged"], s["say_ms"], s["ratio"]]
        for s in real["samples"]
    ]
    print(table(["npc", "source", "parts", "part 0 ms", "LLM request → part 0 ms", "say ms", "part 0 / say"], rows))
    ratios = [s["ratio"] for s in real["samples"] if s["parts"] >= 2]
    median = statistics.median(ratios) if ratios else math.nan
    real_ok = median <= REAL_RATIO_GOAL if ratios else None
    real["median_ratio"] = median
    real["verdict"] = verdict(real_ok)
    print(
        f"  goal median part 0 / say ≤ {REAL_RATIO_GOAL} over the {len(ratios)} replies in 2+ parts: "
        f"{median} → {verdict(real_ok)}; world rule violations: {len(real['violations'])}"
    )

