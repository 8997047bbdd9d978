"""The daemon: supervised components in one TaskGroup, signals → stop event or reload, staged shutdown.

Components (each restarted with backoff if it crashes; 5 crashes of one in 5 minutes end the process
with exit code 1 — bridge/supervisor.py):
    world     WorldLink.run           connect, read, reconnect
    events    world events → dispatcher
    replies   Dispatcher.run          one worker per NPC
    memory    MemoryKeeper.run        silence timers → extraction → checks → store
    watchdog  sd_notify WATCHDOG=1, only while every component runs

SIGHUP reloads the characters folder and the banned words without leaving the world (bridge/reload.py
says what changes), between RELOADING=1 and READY=1.

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
import signal
import time
from collections.abc import Awaitable, Callable

import structlog

from bridge import __version__, faults
from bridge.errors import ComponentFailed, ConfigError
from bridge.llm.base import LLMBackend, model_available
from bridge.llm.factory import make_backend
from bridge.llm.gate import LLMGate
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import Roster, load_roster
from bridge.npc.conversation import Conversations
from bridge.npc.dispatcher import SHUTDOWN_GRACE_SECONDS, Dispatcher
from bridge.npc.responder import Responder
from bridge.reload import ReloadPlan, plan_reload
from bridge.settings import Settings, load_settings
from bridge.supervisor import Supervisor
from bridge.systemd import Notifier
from bridge.world.client import WorldLink

log = structlog.get_logger(__name__)

MEMORY_FLUSH_SECONDS = 3.0
LEAVE_SECONDS = 3.0
# The whole shutdown must fit in the unit's TimeoutStopSec; tests check the sum against it.
SHUTDOWN_BUDGET_SECONDS = SHUTDOWN_GRACE_SECONDS + 2.0 + MEMORY_FLUSH_SECONDS + LEAVE_SECONDS + 2.0


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
        self.failed: str | None = None
        self.supervisor = Supervisor(
            stopping=self.stop_event.is_set, on_change=self._show_status, on_give_up=self._give_up
        )
        self._world_status = "connecting to the world"
        self._reloading = False
        self._reload_again = False
        self._reload_task: asyncio.Task[None] | None = None
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
            on_status=self._on_world_status,
            say_parts=settings.say_parts == "auto",
        )
        self.responder = Responder(backend=self.backend, settings=settings, roster=roster)
        self.dispatcher = Dispatcher(
            roster=roster,
            speaker=self.link,
            responder=self.responder,
            gate=self.gate,
            memory=self.memory,
            conversations=Conversations(history_seconds=settings.history_minutes * 60),
            reply_deadline_seconds=settings.reply_deadline_seconds,
        )

    def request_stop(self, reason: str = "signal") -> None:
        if not self.stop_event.is_set():
            log.info("shutdown_requested", reason=reason)
            self.stop_event.set()

    async def _pump_events(self) -> None:
        async for event in self.link.events():
            self.dispatcher.handle(event)

    # ---- status and supervision ----------------------------------------------------------------

    def _on_world_status(self, line: str) -> None:
        self._world_status = line
        self._show_status()

    def _show_status(self) -> None:
        """One STATUS= line: shutdown, a failure, the components being restarted, a reload, or the world's."""
        restarting = self.supervisor.restarting()
        if "world" in restarting:
            self._world_status = "reconnecting to the world"  # until the restarted link says more
        if self.stop_event.is_set():
            text = f"shutting down: {self.failed}" if self.failed else "shutting down"
        elif self.failed is not None:
            text = self.failed
        elif restarting:
            window_min = self.supervisor.window_seconds / 60
            text = "restarting " + ", ".join(
                f"{name} after a crash ({self.supervisor.recent_crashes(name)} of "
                f"{self.supervisor.max_crashes} allowed in {window_min:g} min)"
                for name in restarting
            )
        elif self._reloading:
            text = "reloading characters"
        else:
            text = self._world_status
        self.notifier.status(text)

    def _give_up(self, name: str, crashes: int) -> None:
        self.failed = (
            f"component {name} crashed {crashes} times in {self.supervisor.window_seconds:g} s; "
            "exiting so that systemd restarts the bridge"
        )
        self.request_stop(f"component {name} failed")

    # ---- reload (SIGHUP) -------------------------------------------------------------------------

    def request_reload(self) -> None:
        if self.stop_event.is_set():
            return
        if self._reload_task is not None and not self._reload_task.done():
            self._reload_again = True  # a file saved during this reload is read by one more
            return
        self._reload_task = asyncio.get_running_loop().create_task(self._reload_loop(), name="reload")

    async def _reload_loop(self) -> None:
        self._reload_again = True
        while self._reload_again and not self.stop_event.is_set():
            self._reload_again = False
            await self._reload()

    async def _reload(self) -> None:
        self.notifier.reloading()
        self._reloading = True
        self._show_status()
        try:
            log.info("reload_started", characters=str(self.settings.characters_dir))
            try:
                loaded = await asyncio.to_thread(load_roster, self.settings.characters_dir)
                banned = load_settings().banned_words
            except ConfigError as exc:
                for line in exc.lines:
                    log.error("reload_problem", problem=line)
                log.error("reload_failed", problems=len(exc.lines), kept="the running characters and banned words")
                return
            await self._apply(plan_reload(self.roster.voiced, loaded.characters), banned)
        except Exception:  # a bug in a reload must not take down the daemon that was running fine
            log.exception("reload_crashed")
        finally:
            self._reloading = False
            self.notifier.reloaded()
            self._show_status()

    async def _apply(self, plan: ReloadPlan, banned: tuple[str, ...]) -> None:
        for npc_id, reason in plan.kept.items():
            log.warning("reload_npc_still_voiced", npc=npc_id, reason=reason, until="the next restart")
        self.roster.replace(plan.characters)
        self.responder.use_banned_words(banned)
        self.dispatcher.voice(self.roster.voiced)
        for npc_id in plan.added:
            try:
                await self.store.load(npc_id)  # as at start: a corrupt file is set aside now
            except Exception as exc:  # noqa: BLE001 - the NPC still talks; its memory says why
                log.warning("reload_memory_unreadable", npc=npc_id, error_type=type(exc).__name__)
        if plan.added:
            self.link.voice(sorted(self.roster.voiced))
        log.info(
            "reload_done",
            added=plan.added,
            changed=plan.changed,
            kept=sorted(plan.kept),
            voiced=sorted(self.roster.voiced),
            banned_words=len(banned),
        )

    # ---- lifetime --------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signal.Signals(signum).name)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
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
                    "watchdog": lambda: self.notifier.watchdog(self.supervisor.all_running),
                }
                tasks = [
                    group.create_task(self.supervisor.supervise(name, faults.wrap(name, component)), name=name)
                    for name, component in components.items()
                ]
                # Everything loaded at start-up (modules, characters, settings) lives as long as the
                # daemon: keep it out of the collector's full passes, which otherwise walk it on
                # every one of them and pause the event loop for milliseconds.
                gc.freeze()
                # Up means up: a world that is down at boot must not fail the unit.
                self.notifier.ready()
                self._show_status()
                group.create_task(self._check_model(), name="model-check")
                await self.stop_event.wait()
                if self._reload_task is not None:
                    self._reload_task.cancel()
                await self._shutdown()
                for task in tasks:
                    task.cancel()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            await self._close_clients()
        log.info("bridge_stopped", failed=self.failed)
        if self.failed is not None:
            raise ComponentFailed(self.failed)
        return 0

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        self._show_status()
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
