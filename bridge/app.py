"""The daemon: supervised components in one TaskGroup, signals → stop event, staged shutdown.

Components (each restarted with backoff if it crashes):
    world     WorldLink.run           connect, read, reconnect
    events    world events → dispatcher
    replies   Dispatcher.run          one worker per NPC
    memory    MemoryKeeper.run        silence timers → extraction → checks → store
    watchdog  sd_notify WATCHDOG=1

Shutdown stages, each bounded so the whole fits well inside systemd's TimeoutStopSec (30 s):
    1. STOPPING=1; no new work (queued lines dropped)          —
    2. replies in flight finish, or get a fallback line          ≤ SHUTDOWN_GRACE_SECONDS + 2
    3. memory: pending conversations are already on disk         ≤ MEMORY_FLUSH_SECONDS
    4. consented leave of the world room                         ≤ LEAVE_SECONDS
    5. cancel the components, close HTTP clients
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import signal
import time
from collections.abc import Awaitable, Callable

import structlog

from bridge import __version__
from bridge.llm.base import LLMBackend, model_available
from bridge.llm.factory import make_backend
from bridge.llm.gate import LLMGate
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import Roster
from bridge.npc.conversation import Conversations
from bridge.npc.dispatcher import SHUTDOWN_GRACE_SECONDS, Dispatcher
from bridge.npc.responder import Responder
from bridge.settings import Settings
from bridge.systemd import Notifier
from bridge.world.client import WorldLink

log = structlog.get_logger(__name__)

MEMORY_FLUSH_SECONDS = 3.0
LEAVE_SECONDS = 3.0
RESTART_BACKOFF_FIRST_SECONDS = 1.0
RESTART_BACKOFF_CAP_SECONDS = 30.0
HEALTHY_RUN_SECONDS = 60.0
# The whole shutdown must fit in the unit's TimeoutStopSec; tests check the sum against it.
SHUTDOWN_BUDGET_SECONDS = SHUTDOWN_GRACE_SECONDS + 2.0 + MEMORY_FLUSH_SECONDS + LEAVE_SECONDS + 2.0


async def supervise(
    name: str,
    component: Callable[[], Awaitable[None]],
    *,
    stopping: Callable[[], bool] = lambda: False,
    first_delay: float = RESTART_BACKOFF_FIRST_SECONDS,
    cap: float = RESTART_BACKOFF_CAP_SECONDS,
    healthy_after: float = HEALTHY_RUN_SECONDS,
) -> None:
    """Run a component until shutdown: a crash is logged with its traceback and the component restarted.

    The delay grows while the component keeps failing quickly and resets after a healthy run.
    """
    delay = first_delay
    while True:
        started = time.monotonic()
        try:
            await component()
            if stopping():
                return
            log.warning("component_returned", component=name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("component_crashed", component=name)
        if time.monotonic() - started >= healthy_after:
            delay = first_delay
        wait = random.uniform(delay / 2, delay)
        log.info("component_restarting", component=name, delay_s=round(wait, 2))
        await asyncio.sleep(wait)
        delay = min(cap, delay * 2)


class App:
    def __init__(
        self,
        settings: Settings,
        roster: Roster,
        *,
        token: str,
        notifier: Notifier | None = None,
        backend: LLMBackend | None = None,
    ) -> None:
        self.settings = settings
        self.roster = roster
        self.notifier = notifier or Notifier()
        self.stop_event = asyncio.Event()
        self.backend = backend or make_backend(settings)
        self.gate = LLMGate(settings.llm_concurrency)
        self.store = MemoryStore(settings.memory_dir, limit=settings.memory_limit)
        self.shared = SharedMemoryClient(settings.shared_memory_url) if settings.shared_memory_url else None
        self.memory = MemoryKeeper(
            store=self.store,
            backend=self.backend,
            gate=self.gate,
            roster=roster,
            settings=settings,
            shared=self.shared,
        )
        self.link = WorldLink(
            url=settings.world_url,
            room=settings.world_room,
            token=token,
            npc_ids=sorted(roster.voiced),
            on_status=self.notifier.status,
            say_parts=settings.say_parts == "auto",
        )
        self.dispatcher = Dispatcher(
            roster=roster,
            speaker=self.link,
            responder=Responder(backend=self.backend, settings=settings, roster=roster),
            gate=self.gate,
            memory=self.memory,
            conversations=Conversations(history_seconds=settings.history_minutes * 60),
            reply_deadline_seconds=settings.reply_deadline_seconds,
            log_content=settings.log_content,
        )

    def request_stop(self, reason: str = "signal") -> None:
        if not self.stop_event.is_set():
            log.info("shutdown_requested", reason=reason)
            self.stop_event.set()

    async def _pump_events(self) -> None:
        async for event in self.link.events():
            self.dispatcher.handle(event)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signal.Signals(signum).name)
        log.info(
            "bridge_starting",
            version=__version__,
            world=self.settings.world_url,
            room=self.settings.world_room,
            backend=self.settings.llm_backend,
            llm=self.settings.llm_url,
            model=self.settings.llm_model,
            npcs=sorted(self.roster.voiced),
        )
        try:
            async with asyncio.TaskGroup() as group:
                components: dict[str, Callable[[], Awaitable[None]]] = {
                    "world": self.link.run,
                    "events": self._pump_events,
                    "replies": self.dispatcher.run,
                    "memory": self.memory.run,
                    "watchdog": self.notifier.watchdog,
                }
                tasks = [
                    group.create_task(supervise(name, component, stopping=self.stop_event.is_set), name=name)
                    for name, component in components.items()
                ]
                # Everything loaded at start-up (modules, characters, settings) lives as long as the
                # daemon: keep it out of the collector's full passes, which otherwise walk it on
                # every one of them and pause the event loop for milliseconds.
                gc.freeze()
                # Up means up: a world that is down at boot must not fail the unit.
                self.notifier.ready()
                self.notifier.status("connecting to the world")
                group.create_task(self._check_model(), name="model-check")
                await self.stop_event.wait()
                await self._shutdown()
                for task in tasks:
                    task.cancel()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            await self._close_clients()
        log.info("bridge_stopped")
        return 0

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        self.notifier.status("shutting down")
        started = time.monotonic()
        try:
            await self.dispatcher.drain(SHUTDOWN_GRACE_SECONDS)
        except Exception:
            # A bug here must not keep the rest of shutdown (the consented leave) from running.
            log.exception("shutdown_drain_failed")
        try:
            async with asyncio.timeout(MEMORY_FLUSH_SECONDS):
                await self.memory.flush(MEMORY_FLUSH_SECONDS)
        except Exception as exc:  # noqa: BLE001 - shutdown goes on
            log.warning("shutdown_memory_flush_failed", error_type=type(exc).__name__)
        try:
            async with asyncio.timeout(LEAVE_SECONDS):
                await self.link.leave()
        except Exception as exc:  # noqa: BLE001
            log.warning("shutdown_leave_failed", error_type=type(exc).__name__)
        log.info("shutdown_stages_done", elapsed_ms=round((time.monotonic() - started) * 1000, 1))

    async def _check_model(self) -> None:
        """Warn (never exit) when the configured model is not on the server."""
        try:
            async with asyncio.timeout(10):
                models = await self.backend.list_models()
        except Exception as exc:  # noqa: BLE001 - only a warning
            log.warning("llm_unreachable_at_start", error_type=type(exc).__name__, error=str(exc))
            return
        wanted = {self.settings.llm_model} | {c.llm.model for c in self.roster.voiced.values() if c.llm.model}
        if models is not None:
            missing = sorted(m for m in wanted if not model_available(m, models))
            if missing:
                log.warning("llm_model_missing", missing=missing, available=models[:20])
            else:
                log.info("llm_models_present", models=sorted(wanted))

    async def _close_clients(self) -> None:
        with contextlib.suppress(Exception):
            await self.backend.aclose()
        if self.shared is not None:
            with contextlib.suppress(Exception):
                await self.shared.aclose()
        self.notifier.close()
