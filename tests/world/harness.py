"""Reference Colyseus worlds (0.16 and 0.18) run as real loopback servers, for any test suite.

    async with running_world("0.18", token="t") as world:      # or: world = await WorldServer.start(...)
        link = WorldLink(url=world.url, room="world", token="t", npc_ids=["cafe-minori"])
        ...
        event_id = await world.inject_talk("cafe-minori", "player-1", "こんにちは")
        said = await world.wait_for_say(lambda s: s["replyTo"] == event_id)

The servers live in tests/world/v016 and tests/world/v018 (shared room: tests/world/common/world.js);
their node_modules are installed with `npm ci` on first use, once per machine state (see README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import httpx

Version = Literal["0.16", "0.18"]
VERSIONS: tuple[Version, ...] = get_args(Version)
WORLD_DIR = Path(__file__).resolve().parent
KNOWN_NPCS = ("cafe-minori", "cinema-aoi", "ryokan-fumi", "haruno")

NPM_CI_TIMEOUT_SECONDS = 300.0
STARTUP_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 5.0
DEBUG_TIMEOUT_SECONDS = 10.0

_installed: set[Path] = set()


class WorldServerError(RuntimeError):
    """The reference world could not be installed or started."""


def version_dir(version: Version) -> Path:
    return WORLD_DIR / ("v" + version.replace(".", ""))


def node_available() -> bool:
    """Whether node and npm are on PATH (world tests skip without them)."""
    return shutil.which("node") is not None and shutil.which("npm") is not None


def ensure_installed(version: Version) -> Path:
    """`npm ci` the version's folder if node_modules is missing or older than its lock file.

    Guarded by a file lock so parallel test sessions in the same tree install only once.
    """
    folder = version_dir(version)
    if folder in _installed:
        return folder
    lock_path = Path(tempfile.gettempdir()) / (
        "npc-bridge-world-" + hashlib.sha256(str(folder).encode()).hexdigest()[:16] + ".lock"
    )
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = folder / "node_modules" / ".package-lock.json"
        lock_file = folder / "package-lock.json"
        if not marker.exists() or marker.stat().st_mtime < lock_file.stat().st_mtime:
            result = subprocess.run(
                ["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=NPM_CI_TIMEOUT_SECONDS,
                check=False,
            )
            if result.returncode != 0:
                raise WorldServerError(f"npm ci failed in {folder}:\n{result.stdout}\n{result.stderr}")
    _installed.add(folder)
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class WorldServer:
    """One reference world process on a loopback port, with its debug endpoints."""

    def __init__(
        self,
        version: Version,
        token: str,
        port: int,
        *,
        reconnect_seconds: float,
        say_parts: bool = False,
        extra_npcs: Sequence[str] = (),
    ) -> None:
        self.version = version
        self.token = token
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.reconnect_seconds = reconnect_seconds
        self.say_parts = say_parts  # offer "say-parts" in worker:claimed (at the next start)
        self.extra_npcs = tuple(extra_npcs)  # granted besides KNOWN_NPCS
        self._process: subprocess.Popen[bytes] | None = None
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"npc-bridge-world-{version}-"))
        self._log_path = self._log_dir / "world.log"

    def __repr__(self) -> str:
        return f"WorldServer(version={self.version!r}, url={self.url!r})"

    # ------------------------------------------------------------ process control

    @classmethod
    async def start(
        cls,
        version: Version,
        token: str,
        *,
        port: int | None = None,
        reconnect_seconds: float = 20.0,
        say_parts: bool = False,
        extra_npcs: Sequence[str] = (),
    ) -> WorldServer:
        """Install if needed, start on a free loopback port (or `port`) and wait until it listens.

        `say_parts`: the world offers `"features": ["say-parts"]` in its claim answers.
        `extra_npcs`: NPC ids the world grants besides `KNOWN_NPCS` (large rosters).
        """
        if version not in VERSIONS:
            raise ValueError(f"unknown Colyseus version {version!r}")
        await asyncio.to_thread(ensure_installed, version)
        server = cls(
            version,
            token,
            port or free_port(),
            reconnect_seconds=reconnect_seconds,
            say_parts=say_parts,
            extra_npcs=extra_npcs,
        )
        await server._spawn()
        return server

    def _popen(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update(
            PORT=str(self.port),
            WORLD_TOKEN=self.token,
            RECONNECT_SECONDS=str(self.reconnect_seconds),
            SAY_PARTS="1" if self.say_parts else "0",
            EXTRA_NPCS=",".join(self.extra_npcs),
            NODE_ENV="development",
        )
        with open(self._log_path, "ab") as log_file:
            return subprocess.Popen(
                ["node", "server.js"],
                cwd=version_dir(self.version),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def _spawn(self) -> None:
        self._process = self._popen()
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise WorldServerError(f"world {self.version} exited early:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{self.url}/debug/health")
                    if response.status_code == 200:
                        return
                await asyncio.sleep(0.05)
        self.kill()
        raise WorldServerError(f"world {self.version} did not listen on {self.port}:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the world vanishes without closing its sockets."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_SECONDS)

    async def restart(self, *, say_parts: bool | None = None) -> None:
        """Kill (if running) and start again on the same port; the new process has an empty record.

        `say_parts` (when given) changes whether the new process offers the say-parts feature.
        """
        self.kill()
        if say_parts is not None:
            self.say_parts = say_parts
        await self._spawn()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------ debug endpoints

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=DEBUG_TIMEOUT_SECONDS) as client:
            response = await client.post(f"{self.url}{path}", json=body)
            response.raise_for_status()
            answer: dict[str, Any] = response.json()
            return answer

    async def record(self) -> dict[str, Any]:
        """Everything the room recorded: said, typed, claims, joins, leaves, drops, reconnects, …"""
        async with httpx.AsyncClient(timeout=DEBUG_TIMEOUT_SECONDS) as client:
            response = await client.get(f"{self.url}/debug/record")
            response.raise_for_status()
            answer: dict[str, Any] = response.json()
            return answer

    async def inject_talk(
        self,
        npc_id: str,
        player_id: str,
        text: str,
        *,
        player_name: str = "旅人1",
        event_id: str | None = None,
        at: float | None = None,
    ) -> str:
        """Send `npc:talk` to the worker clients; return the event id."""
        body: dict[str, Any] = {
            "npcId": npc_id,
            "playerId": player_id,
            "playerName": player_name,
            "text": text,
        }
        if event_id is not None:
            body["id"] = event_id
        if at is not None:
            body["at"] = at
        answer = await self._post("/debug/talk", body)
        return str(answer["id"])

    async def inject_event(
        self,
        npc_id: str,
        kind: str,
        text: str,
        *,
        player_id: str | None = None,
        at: float | None = None,
    ) -> int:
        """Send `npc:event`; return how many workers it went to."""
        body: dict[str, Any] = {"npcId": npc_id, "kind": kind, "text": text, "playerId": player_id}
        if at is not None:
            body["at"] = at
        return int((await self._post("/debug/event", body))["sent"])

    async def inject_left(self, player_id: str, *, at: float | None = None) -> int:
        """Send `player:left`; return how many workers it went to."""
        body: dict[str, Any] = {"playerId": player_id}
        if at is not None:
            body["at"] = at
        return int((await self._post("/debug/left", body))["sent"])

    async def inject_message(self, message_type: str, payload: Any) -> int:
        """Send any type with any payload (as Colyseus encodes it): unknown types, broken payloads."""
        return int((await self._post("/debug/send", {"type": message_type, "payload": payload}))["sent"])

    async def inject_frame(self, frame: bytes) -> int:
        """Write raw bytes onto the worker sockets: malformed frames."""
        return int((await self._post("/debug/raw", {"hex": frame.hex()}))["sent"])

    async def set_state_size(self, size_bytes: int) -> None:
        """Make the room state about `size_bytes` big (a string field); every client gets the patch."""
        await self._post("/debug/state", {"bytes": size_bytes})

    async def set_say_parts(self, offered: bool) -> None:
        """Offer say-parts (or stop offering it) in the claim answers from now on, without a restart.

        Connections already claimed keep what they were told; `drop_workers()` makes the link
        reconnect and claim again, and so learn the new answer.
        """
        await self._post("/debug/features", {"sayParts": offered})
        self.say_parts = offered

    async def drop_workers(self) -> int:
        """Cut the worker sockets without a close frame (the room allows reconnection)."""
        return int((await self._post("/debug/drop", {}))["sent"])

    async def said(self) -> list[dict[str, Any]]:
        """The `npc:say` payloads the room received, oldest first."""
        return [entry["payload"] for entry in (await self.record())["said"]]

    async def typed(self) -> list[dict[str, Any]]:
        """The `npc:typing` payloads the room received, oldest first."""
        return [entry["payload"] for entry in (await self.record())["typed"]]

    async def parts(self, reply_to: str | None = None) -> list[dict[str, Any]]:
        """The `npc:say:part` payloads the room received (of one reply, if `reply_to`), oldest first."""
        return [
            entry["payload"]
            for entry in (await self.record())["parts"]
            if reply_to is None or entry["payload"].get("replyTo") == reply_to
        ]

    async def violations(self) -> list[dict[str, Any]]:
        """Say-parts rules the bridge broke, as the world saw them (empty when all is well).

        Each is `{"rule", "replyTo", "sessionId", "detail", "at"}`; rules: `part_not_offered`,
        `part_after_say`, `part_out_of_order`, `part_empty`, `say_differs_from_parts`,
        `say_emotion_differs`.
        """
        violations: list[dict[str, Any]] = (await self.record())["violations"]
        return violations

    async def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Poll the record until `predicate(record)` holds; return that record."""
        deadline = time.monotonic() + timeout
        while True:
            record = await self.record()
            if predicate(record):
                return record
            if time.monotonic() >= deadline:
                raise TimeoutError(f"world {self.version}: condition not met in {timeout} s")
            await asyncio.sleep(0.05)

    async def wait_for_say(
        self,
        predicate: Callable[[dict[str, Any]], bool] | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Wait until the room received an `npc:say` matching `predicate` (any, if None); return it."""
        found: list[dict[str, Any]] = []

        def matches(record: dict[str, Any]) -> bool:
            found[:] = [e["payload"] for e in record["said"] if predicate is None or predicate(e["payload"])]
            return bool(found)

        await self.wait_for(matches, timeout)
        return found[0]

    async def wait_for_part(
        self,
        predicate: Callable[[dict[str, Any]], bool] | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Wait until the room received an `npc:say:part` matching `predicate` (any, if None); return it."""
        found: list[dict[str, Any]] = []

        def matches(record: dict[str, Any]) -> bool:
            found[:] = [e["payload"] for e in record["parts"] if predicate is None or predicate(e["payload"])]
            return bool(found)

        await self.wait_for(matches, timeout)
        return found[0]

    async def wait_for_worker(self, timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109
        """Wait until a worker is in the room and has claimed; return the record."""
        return await self.wait_for(lambda r: bool(r["workers"]) and bool(r["claims"]), timeout)


@contextlib.asynccontextmanager
async def running_world(version: Version, token: str, **options: Any) -> AsyncIterator[WorldServer]:
    """`WorldServer.start(...)`, stopped on exit."""
    server = await WorldServer.start(version, token, **options)
    try:
        yield server
    finally:
        await server.stop()
