"""systemd: sd_notify datagrams on a real socket, the watchdog cadence, and the unit file itself."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
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


def test_a_listener_that_does_not_read_never_blocks_the_daemon(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    started = time.monotonic()
    for n in range(500):  # far more than a datagram socket queues
        notifier.status(f"status {n}")
    assert time.monotonic() - started < 2.0
    assert sock.recv(4096) == b"STATUS=status 0"
    notifier.close()


def test_reloading_carries_the_monotonic_time(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    notifier.reloaded()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, ready = sock.recv(4096).decode(), sock.recv(4096).decode()
    first, second = reloading.split("\n")
    assert first == "RELOADING=1" and ready == "READY=1"
    assert second.startswith("MONOTONIC_USEC=") and before <= int(second.split("=")[1]) <= after
    notifier.close()


async def test_watchdog_is_withheld_while_not_healthy(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    sock.setblocking(False)
    healthy = [False]
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid())})
    task = asyncio.create_task(notifier.watchdog(lambda: healthy[0]))
    await asyncio.sleep(0.3)
    with pytest.raises(BlockingIOError):
        sock.recv(64)
    healthy[0] = True
    await asyncio.sleep(0.2)
    task.cancel()
    assert sock.recv(64) == b"WATCHDOG=1"
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


UNITS = {"plain": UNIT, "template": REPO / "systemd" / "npc-bridge@.service"}
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="SKIPPED LOUDLY: systemd-analyze not installed (Debian package systemd; .ci/run installs it)",
)


@pytest.mark.parametrize("kind", list(UNITS))
def test_unit_file_has_the_required_settings(kind: str) -> None:
    text = UNITS[kind].read_text(encoding="utf-8")
    for setting in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "EnvironmentFile=",
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RestartPreventExitStatus=2",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ):
        assert setting in text.splitlines() or any(line.startswith(setting) for line in text.splitlines()), setting
    assert "NPC_BRIDGE_WORLD_TOKEN" not in "".join(
        line for line in text.splitlines() if not line.startswith("#")
    )  # the token never sits in the unit


def test_the_plain_unit_loads_the_token_as_a_credential() -> None:
    lines = UNIT.read_text(encoding="utf-8").splitlines()
    assert "LoadCredential=world-token:/etc/npc-bridge/world-token" in lines
    assert "StateDirectory=npc-bridge" in lines and "Environment=NPC_BRIDGE_MEMORY_DIR=%S/npc-bridge" in lines


def test_the_template_unit_keeps_each_instance_apart() -> None:
    lines = UNITS["template"].read_text(encoding="utf-8").splitlines()
    for line in (
        "EnvironmentFile=/etc/npc-bridge/%i.env",
        "LoadCredential=world-token:/etc/npc-bridge/%i.world-token",
        "StateDirectory=npc-bridge/%i",
        "Environment=NPC_BRIDGE_MEMORY_DIR=%S/npc-bridge/%i",
        "Environment=NPC_BRIDGE_WORLD_ROOM=%i",
    ):
        assert line in lines, line


@pytest.mark.parametrize("kind", list(UNITS))
def test_shutdown_stages_fit_inside_the_units_stop_timeout(kind: str) -> None:
    text = UNITS[kind].read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith("TimeoutStopSec=")]
    timeout_seconds = float(line.split("=", 1)[1].rstrip("s"))
    assert app.SHUTDOWN_BUDGET_SECONDS < timeout_seconds


def _installable(tmp_path: Path, kind: str) -> Path:
    """The unit as systemd-analyze can load it: ExecStart pointing at a real executable (verify insists),
    a template as one instance of it."""
    beside = Path(sys.executable).parent / "npc-bridge"
    executable = str(beside) if beside.exists() else shutil.which("npc-bridge") or sys.executable
    name = "npc-bridge.service" if kind == "plain" else "npc-bridge@town.service"
    unit = tmp_path / name
    unit.write_text(
        UNITS[kind].read_text(encoding="utf-8").replace("/opt/npc-bridge/.venv/bin/npc-bridge", executable),
        encoding="utf-8",
    )
    return unit


@needs_systemd_analyze
@pytest.mark.parametrize("kind", list(UNITS))
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path, kind: str) -> None:
    unit = _installable(tmp_path, kind)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    problems = [
        line for line in (result.stderr + result.stdout).splitlines() if unit.name in line and "Failed to" not in line
    ]
    assert result.returncode == 0 and not problems, result.stderr + result.stdout


@needs_systemd_analyze
@pytest.mark.parametrize("kind", list(UNITS))
def test_unit_file_exposure_is_at_most_1_5(tmp_path: Path, kind: str) -> None:
    unit = _installable(tmp_path, kind)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=15", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    (line,) = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    exposure = float(line.split(":")[1].split()[0])
    assert exposure <= 1.5, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
