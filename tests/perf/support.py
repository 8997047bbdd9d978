"""Benchmark plumbing: a wall-clock-stamping fake Ollama, the daemon as a subprocess, /proc sampling, stats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from tests.fakes.llm_servers import Answer, Behaviour, FakeOllama, RecordedRequest
from tests.world.harness import WorldServer

REPO = Path(__file__).resolve().parents[2]
BRIDGE = [sys.executable, "-m", "bridge", "run"]
STAFF = ("cafe-minori", "cinema-aoi", "ryokan-fumi")
TOKEN = "perf-bench-token-5c1e"
# Event ids carry this shape so the fake LLM can find which talk a request answers.
TAG_RE = re.compile(r"ev\d{3}-\d{6}")
CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ---- the loopback LLM ----------------------------------------------------------------------------------


@dataclass
class Timing:
    """One generation request on the benchmark's wall clock (time.time(), seconds)."""

    arrived: float  # the handler started: headers in, body not yet read
    tag: str | None = None
    writes: list[float] = field(default_factory=list)  # after each write of a stream piece (last: done line)
    record: RecordedRequest | None = None
    extraction: bool = False


class TimedOllama(FakeOllama):
    """FakeOllama that stamps, on the wall clock, each request's arrival and every write of its answer."""

    def __init__(self, *, token_period_seconds: float = 0.0, **options: Any) -> None:
        super().__init__(**options)
        # > 0: text pieces go out on a fixed schedule from the request's arrival (piece n at (n + 1)
        # periods), as a model decoding at a steady rate does; no drift from one sleep to the next.
        self.token_period_seconds = token_period_seconds
        self.timings: list[Timing] = []
        self._live: dict[int, Timing] = {}

    async def _handle_generation(self, request: web.Request) -> web.StreamResponse:
        timing = Timing(arrived=time.time())
        self._live[id(request)] = timing
        try:
            return await super()._handle_generation(request)
        finally:
            self._live.pop(id(request), None)

    async def _answer_text(
        self, request: web.Request, record: RecordedRequest, answer: Answer, body: dict[str, Any]
    ) -> web.StreamResponse:
        timing = self._live.get(id(request))
        if timing is not None:
            timing.record = record
            timing.extraction = "format" in body
            timing.tag = find_tag(record.messages)
            self.timings.append(timing)
        return await super()._answer_text(request, record, answer, body)

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        timing = self._live.get(id(request))
        record = timing.record if timing is not None else None
        if self.token_period_seconds and timing is not None and record is not None:
            if record.pieces_sent < record.pieces_planned:  # a text piece, not the closing line
                due = timing.arrived + (record.pieces_sent + 1) * self.token_period_seconds
                await asyncio.sleep(max(0.0, due - time.time()))
        await super()._write(request, response, data)
        if timing is not None:
            timing.writes.append(time.time())

    def first_by_tag(self) -> dict[str, Timing]:
        return first_by_tag(self.timings)


def first_by_tag(timings: Sequence[Timing]) -> dict[str, Timing]:
    """The first request made for each tagged talk (a regeneration would be a second one)."""
    found: dict[str, Timing] = {}
    for timing in timings:
        if timing.tag is not None and timing.tag not in found:
            found[timing.tag] = timing
    return found


class LLMProcess:
    """The instant loopback LLM of `llm_process.py`, run as a subprocess; its stamps read over HTTP."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""

    async def __aenter__(self) -> LLMProcess:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.perf.llm_process", cwd=REPO, stdout=asyncio.subprocess.PIPE
        )
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 30)
        self.url = line.decode().strip()
        if not self.url.startswith("http://"):
            raise RuntimeError(f"the loopback LLM process did not start: {line!r}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    async def first_by_tag(self) -> dict[str, Timing]:
        async with httpx.AsyncClient(timeout=10.0) as client:
            rows = (await client.get(f"{self.url}/bench/timings")).json()
        timings = [
            Timing(arrived=row["arrived"], tag=row["tag"], writes=row["writes"], extraction=row["extraction"])
            for row in rows
        ]
        return first_by_tag(timings)


def instant_answer(counter: list[int]) -> Callable[[dict[str, Any]], Answer | str]:
    """Two sentences, never the same twice (the bridge regenerates a repeated line), sent at once."""

    def respond(body: dict[str, Any]) -> Answer | str:
        if "format" in body:
            return '{"memories": []}'
        counter[0] += 1
        return f"[happy]いらっしゃいませ、{counter[0]}番目のお客様ですね。どうぞごゆっくりお過ごしください。"

    return respond


def find_tag(messages: Sequence[dict[str, Any]]) -> str | None:
    """The event tag in the last user message (the player's line)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            match = TAG_RE.search(str(message.get("content", "")))
            return match.group(0) if match else None
    return None


def token_pieces(sentences: Sequence[str], chars_per_token: int = 2) -> tuple[tuple[str, ...], list[int]]:
    """Sentences cut into 'tokens' of `chars_per_token` characters, each sentence starting a new token
    (so an end mark always ends a token, as 「。」 does with real tokenizers); also the index of each
    sentence's last token."""
    pieces: list[str] = []
    ends: list[int] = []
    for sentence in sentences:
        pieces.extend(sentence[i : i + chars_per_token] for i in range(0, len(sentence), chars_per_token))
        ends.append(len(pieces) - 1)
    return tuple(pieces), ends


# ---- the daemon ----------------------------------------------------------------------------------------


def staff_characters(directory: Path) -> Path:
    """A characters folder with only the three staff (the home character left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    for npc_id in STAFF:
        shutil.copy(REPO / "characters" / f"{npc_id}.json", directory / f"{npc_id}.json")
    return directory


def bridge_env(work: Path, world_url: str, llm_url: str, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPC_BRIDGE_") and k != "NOTIFY_SOCKET"}
    env.update(
        NPC_BRIDGE_WORLD_URL=world_url,
        NPC_BRIDGE_WORLD_TOKEN=TOKEN,
        NPC_BRIDGE_LLM_URL=llm_url,
        NPC_BRIDGE_CHARACTERS_DIR=str(staff_characters(work / "characters")),
        NPC_BRIDGE_MEMORY_DIR=str(work / "memory"),
        NPC_BRIDGE_LOG_FORMAT="json",
        PYTHONUNBUFFERED="1",
    )
    env.update(values)
    return env


class Daemon:
    """`python -m bridge run` as a subprocess, its JSON log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path, *, profile_path: Path | None = None) -> None:
        self.env = env
        self.log_path = log_path
        self.profile_path = profile_path
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, world: WorldServer, timeout_seconds: float = 30.0) -> None:
        command = list(BRIDGE)
        if self.profile_path is not None:
            # cProfile writes its figures when the daemon exits after SIGTERM.
            command[1:1] = ["-m", "cProfile", "-o", str(self.profile_path)]
        with self.log_path.open("wb") as log_file:
            self.process = await asyncio.create_subprocess_exec(
                *command, cwd=REPO, env=self.env, stdout=log_file, stderr=asyncio.subprocess.STDOUT
            )
        await world.wait_for(lambda r: bool(r["workers"]) and bool(r["claims"]), timeout_seconds)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def stop(self) -> int | None:
        process = self.process
        if process is None or process.returncode is not None:
            return process.returncode if process else None
        process.terminate()
        try:
            return await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            return await process.wait()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


# ---- the world -----------------------------------------------------------------------------------------


class Injector:
    """Posts `npc:talk` to the world's debug endpoint over one kept-alive connection."""

    def __init__(self, world: WorldServer) -> None:
        self.world = world
        self.client = httpx.AsyncClient(base_url=world.url, timeout=10.0)
        self.posted: dict[str, tuple[float, float]] = {}  # event id -> (before POST, after answer)

    async def talk(self, event_id: str, npc_id: str, player_id: str, text: str, player_name: str) -> None:
        body = {"id": event_id, "npcId": npc_id, "playerId": player_id, "playerName": player_name, "text": text}
        before = time.time()
        response = await self.client.post("/debug/talk", json=body)
        after = time.time()
        response.raise_for_status()
        self.posted[event_id] = (before, after)

    async def aclose(self) -> None:
        await self.client.aclose()


def said_at_seconds(entry: dict[str, Any]) -> float:
    """When the world received an `npc:say`: a sub-ms stamp if the world records one, else Date.now()."""
    stamp = entry.get("atHr", entry["at"])
    return float(stamp) / 1000.0


def world_talk_stamps(record: dict[str, Any]) -> dict[str, float]:
    """Event id → when the world sent the talk, if its record keeps talks (else empty)."""
    stamps: dict[str, float] = {}
    for entry in record.get("talks", []) or []:
        payload = entry.get("payload", entry)
        if isinstance(payload, dict) and "id" in payload:
            stamps[str(payload["id"])] = float(entry.get("atHr", entry.get("at"))) / 1000.0
    return stamps


def world_stamp_resolution(record: dict[str, Any]) -> str:
    said = record.get("said") or []
    if said and "atHr" in said[0]:
        return "sub-ms (atHr)"
    return "1 ms (Date.now(), integer)"


# ---- /proc ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    at: float  # time.monotonic()
    cpu_ticks: int  # utime + stime
    rss_bytes: int
    hwm_bytes: int


def proc_sample(pid: int) -> ProcSample:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces: fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return ProcSample(time.monotonic(), ticks, rss, hwm)


def cpu_percent(first: ProcSample, last: ProcSample) -> float:
    seconds = last.at - first.at
    return 100.0 * (last.cpu_ticks - first.cpu_ticks) / CLOCK_TICKS_PER_SECOND / seconds if seconds > 0 else 0.0


# ---- figures -------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary_ms(values_seconds: Sequence[float]) -> dict[str, float | int]:
    ms = [v * 1000.0 for v in values_seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3) if ms else math.nan,
        "min_ms": round(min(ms), 3) if ms else math.nan,
    }


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.2f}"
    return str(value)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


async def wait_until(predicate: Callable[[], bool], timeout_seconds: float, step_seconds: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step_seconds)
    return True


__all__ = [
    "Answer",
    "Behaviour",
    "Daemon",
    "Injector",
    "ProcSample",
    "TimedOllama",
    "Timing",
]


# ---- the streamed fake of parts 2 and 7 ----------------------------------------------------------------

TOKENS_PER_SECOND = 20.0
# Four sentences per staff NPC, an emotion tag first: what the streamed fake LLM writes.
STREAMED_REPLIES = {
    "cafe-minori": (
        "[happy]",
        "いらっしゃいませ、今日は少し肌寒いですね。",
        "温かいカフェラテはいかがでしょうか。",
        "焼きたてのスコーンもご用意しております。",
        "お席はお好きなところへどうぞ。",
    ),
    "cinema-aoi": (
        "[relaxed]",
        "こんばんは、今夜のレイトショーはまだお席がありますよ。",
        "真ん中あたりの列が見やすいと思います。",
        "ポップコーンは塩とキャラメルがございます。",
        "上映までもう少しお待ちくださいね。",
    ),
    "ryokan-fumi": (
        "[relaxed]",
        "おかえりなさいませ。",
        "お越しいただきありがとうございます。",
        "山の麓で降り立つと、涼やかな風が心地よい季節です。",
        "今日はどうぞごゆっくりとお過ごしくださいね。",
    ),
}


StreamedPlans = dict[str, tuple[tuple[str, ...], list[int]]]


def streamed_plans() -> StreamedPlans:
    """Each staff NPC's reply as token pieces, and the token index at each sentence end (tag left out)."""
    plans: StreamedPlans = {}
    for npc, (tag, *sentences) in STREAMED_REPLIES.items():
        pieces, ends = token_pieces([tag, *sentences])
        plans[npc] = (pieces, ends[1:])
    return plans


def npc_name(npc_id: str) -> str:
    return str(json.loads((REPO / "characters" / f"{npc_id}.json").read_text(encoding="utf-8"))["name"])


def streamed_answer(plans: StreamedPlans) -> Callable[[dict[str, Any]], Answer | str]:
    """The fake's answer: the addressed NPC's streamed reply (told apart by its name in the system
    message), and an empty memory list for an extraction."""

    def respond(body: dict[str, Any]) -> Answer | str:
        if "format" in body:
            return '{"memories": []}'
        system = str(body.get("messages", [{}])[0].get("content", ""))
        npc = next((n for n in STAFF if npc_name(n) in system), "cafe-minori")
        return Answer(plans[npc][0])

    return respond
