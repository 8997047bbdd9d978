"""Running the real `npc-bridge` process in tests: its environment, start, stop and JSON log lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BRIDGE = (sys.executable, "-m", "bridge")
STOP_SECONDS = 30.0


def bridge_env(memory_dir: Path, **values: str) -> dict[str, str]:
    """This process's environment without any NPC_BRIDGE_* or systemd variable, plus `values`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("NPC_BRIDGE_")
        and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "CREDENTIALS_DIRECTORY")
    }
    env.update(
        NPC_BRIDGE_CHARACTERS_DIR=str(REPO / "characters"),
        NPC_BRIDGE_MEMORY_DIR=str(memory_dir),
        PYTHONUNBUFFERED="1",
    )
    env.update(values)
    return env


async def start_bridge(env: dict[str, str], log_path: Path, *args: str) -> asyncio.subprocess.Process:
    """`npc-bridge run` (or `args`) with stdout and stderr appended to `log_path`."""
    with log_path.open("ab") as log_file:
        return await asyncio.create_subprocess_exec(
            *BRIDGE, *(args or ("run",)), env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT
        )


async def stop_bridge(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM and the exit code (killed, and an assertion error, if it does not stop in time)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_SECONDS)
        except TimeoutError:
            proc.kill()
            raise AssertionError(f"npc-bridge did not stop within {STOP_SECONDS} s of SIGTERM") from None
    assert proc.returncode is not None
    return proc.returncode


def log_events(log_path: Path) -> list[dict[str, Any]]:
    """The JSON log lines the daemon wrote."""
    return [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines() if line.startswith("{")]


def read_log(log_path: Path) -> str:
    return log_path.read_text(encoding="utf-8") if log_path.exists() else ""


async def wait_for_log(
    log_path: Path,
    predicate: Any,
    timeout: float = 20.0,  # noqa: ASYNC109
    proc: asyncio.subprocess.Process | None = None,
) -> dict[str, Any]:
    """Poll the daemon's JSON log until a line matches `predicate(line)`; return that line."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for event in log_events(log_path):
            if predicate(event):
                return event
        if proc is not None and proc.returncode is not None:
            raise AssertionError(f"npc-bridge exited ({proc.returncode}) first:\n{read_log(log_path)[-4000:]}")
        if loop.time() >= deadline:
            raise AssertionError(f"no such log line in {timeout} s:\n{read_log(log_path)[-4000:]}")
        await asyncio.sleep(0.05)


class NotifyListener:
    """A real NOTIFY_SOCKET: the datagram socket systemd would listen on, read by the test."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.setblocking(False)
        self.messages: list[str] = []
        self.arrived: list[float] = []  # time.monotonic() each message was read, beside `messages`
        self._cursor = 0  # wait_for looks only after the message the previous wait_for returned
        # Read as they come, as systemd does: the kernel queues only a few datagrams per socket.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self.read)

    def env(self, watchdog_usec: int | None = None) -> dict[str, str]:
        values = {"NOTIFY_SOCKET": str(self.path)}
        if watchdog_usec is not None:
            values["WATCHDOG_USEC"] = str(watchdog_usec)
        return values

    def read(self) -> list[str]:
        """Every datagram so far, in the order sent."""
        while self._sock.fileno() != -1:
            try:
                self.messages.append(self._sock.recv(65536).decode())
                self.arrived.append(time.monotonic())
            except BlockingIOError:
                break
        return self.messages

    async def wait_for(self, predicate: Any, timeout: float = 20.0) -> str:  # noqa: ASYNC109
        """The first message after the previous wait_for's that matches `predicate`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            messages = self.read()
            for index in range(self._cursor, len(messages)):
                if predicate(messages[index]):
                    self._cursor = index + 1
                    return messages[index]
            if loop.time() >= deadline:
                raise AssertionError(f"no such notify message in {timeout} s; got {messages[-20:]}")
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self.read()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()


def force_crash(fault_dir: Path, component: str, times: int = 1) -> None:
    """Make `component` of a daemon started with NPC_BRIDGE_TEST_FAULTS=fault_dir crash `times` times in a
    row (bridge/faults.py); written whole (a rename), so the daemon never reads half a file."""
    fault_dir.mkdir(parents=True, exist_ok=True)
    part = fault_dir / f".{component}.part"
    part.write_text(str(times), encoding="ascii")
    part.rename(fault_dir / component)
