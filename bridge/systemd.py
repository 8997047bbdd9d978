"""sd_notify over the NOTIFY_SOCKET datagram socket, and the watchdog heartbeat; no-ops outside systemd."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    """Sends `READY=1`, `STATUS=…`, `STOPPING=1` and `WATCHDOG=1` to systemd (Type=notify)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        self._last_status: str | None = None
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
            self._socket.sendto(message.encode("utf-8"), self._address)
        except OSError as exc:
            # systemd going away must never take the daemon with it.
            log.warning("sd_notify_failed", error=str(exc))

    def ready(self) -> None:
        self.notify("READY=1")

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.notify(f"STATUS={text}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    async def watchdog(self) -> None:
        """Ping at half the watchdog interval from the event loop: a blocked loop stops the pings.

        Without a watchdog it waits forever (cancel it), so a supervisor never sees it end.
        """
        if self.watchdog_seconds is None or not self._address:
            await asyncio.Event().wait()
            return
        interval = self.watchdog_seconds / 2
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
