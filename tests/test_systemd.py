"""systemd: sd_notify datagrams on a real socket, the watchdog cadence, and the unit file itself."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge import app
from bridge.systemd import Notifier

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "npc-bridge.service"


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


def test_notifier_sends_ready_status_and_stopping(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.ready()
    notifier.status("joined world")
    notifier.status("joined world")  # unchanged status is not sent twice
    notifier.status("world unreachable, retrying in 8 s")
    notifier.stopping()
    received = [sock.recv(4096).decode() for _ in range(4)]
    assert received == [
        "READY=1",
        "STATUS=joined world",
        "STATUS=world unreachable, retrying in 8 s",
        "STOPPING=1",
    ]
    notifier.close()


def test_abstract_namespace_socket_is_supported() -> None:
    name = f"npc-bridge-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(64) == b"READY=1"
    finally:
        sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    notifier.ready()
    notifier.status("x")
    # Without a watchdog it waits until cancelled, so a supervisor never sees it end and restart it.
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(notifier.watchdog(), 0.2))


async def test_watchdog_pings_at_half_the_interval(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())})
    assert notifier.watchdog_seconds == pytest.approx(0.2)
    task = asyncio.create_task(notifier.watchdog())
    await asyncio.sleep(0.35)
    task.cancel()
    pings = []
    while True:
        try:
            pings.append(sock.recv(64))
        except BlockingIOError:
            break
    # t=0, 0.1, 0.2, 0.3: four pings at 0.1 s (half of 0.2 s), give or take scheduling.
    assert pings and set(pings) == {b"WATCHDOG=1"}
    assert 3 <= len(pings) <= 5


def test_watchdog_for_another_pid_is_ignored() -> None:
    notifier = Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_seconds is None


def test_unit_file_has_the_required_settings() -> None:
    text = UNIT.read_text(encoding="utf-8")
    for setting in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "StateDirectory=npc-bridge",
        "NPC_BRIDGE_MEMORY_DIR=%S/npc-bridge",
        "EnvironmentFile=",
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RestartPreventExitStatus=2",
    ):
        assert setting in text, setting


def test_shutdown_stages_fit_inside_the_units_stop_timeout() -> None:
    text = UNIT.read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith("TimeoutStopSec=")]
    timeout_seconds = float(line.split("=", 1)[1].rstrip("s"))
    assert app.SHUTDOWN_BUDGET_SECONDS < timeout_seconds


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (Debian package systemd)"
)
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart exists: point it at this checkout's real console script.
    executable = shutil.which("npc-bridge") or str(REPO / ".venv" / "bin" / "npc-bridge")
    unit = tmp_path / "npc-bridge.service"
    unit.write_text(
        UNIT.read_text(encoding="utf-8").replace("/opt/npc-bridge/.venv/bin/npc-bridge", executable),
        encoding="utf-8",
    )
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    problems = [
        line
        for line in (result.stderr + result.stdout).splitlines()
        if "npc-bridge.service" in line and "Failed to" not in line
    ]
    assert result.returncode == 0 and not problems, result.stderr + result.stdout
