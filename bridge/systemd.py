"""sd_notify over the NOTIFY_SOCKET datagram socket, and the watchdog heartbeat; no-ops outside systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    """Sends `READY=1`, `STATUS=…`, `RELOADING=1`, `STOPPING=1` and `WATCHDOG=1` to systemd (Type=notify)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        self._last_status: str | None = None
        self._failing = False
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_seconds: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_seconds = int(usec) / 1_000_000

    def notify(self, message: str) -> None:
        if not self._address:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never block the event loop: a listener that does not read (its queue holds only a
                # few datagrams) costs a dropped message, not a frozen daemon.
                self._socket.setblocking(False)
            self._socket.sendto(message.encode("utf-8"), self._address)
            self._failing = False
        except OSError as exc:
            # systemd going away must never take the daemon with it; one warning per run of failures.
            if not self._failing:
                self._failing = True
                log.warning("sd_notify_failed", error=str(exc), message=message.split("\n", 1)[0])

    def ready(self) -> None:
        self.notify("READY=1")

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.notify(f"STATUS={text}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def reloading(self) -> None:
        """Start of a reload (Type=notify-reload protocol): systemd wants the monotonic time with it."""
        self.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def reloaded(self) -> None:
        """End of a reload: up again (`READY=1`)."""
        self.notify("READY=1")

    async def watchdog(self, healthy: Callable[[], bool] = lambda: True) -> None:
        """Ping at half the watchdog interval from the event loop while `healthy()`.

        A ping says more than "the loop turns": it is withheld while `healthy()` is false (a component
        waiting to be restarted), so a daemon that cannot recover is restarted by systemd. Without a
        watchdog it waits forever (cancel it), so a supervisor never sees it end.
        """
        if self.watchdog_seconds is None or not self._address:
            await asyncio.Event().wait()
            return
        interval = self.watchdog_seconds / 2
        withheld = False
        while True:
            if healthy():
                self.notify("WATCHDOG=1")
                withheld = False
            elif not withheld:
                withheld = True
                log.warning("watchdog_ping_withheld", reason="a component is not running")
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
