"""A loopback fake of the shared long-term memory service (memory.md "Shared memory"), with aiohttp.

    async with FakeMemoryService() as service:
        service.stored.append({"text": "…", "created_at": "…", "source": "…"})
        client = SharedMemoryClient(service.url)
        ...
        await service.stop()    # refused connections, same port
        await service.start()   # up again on the same port

`/recall` answers the stored memories that share a character with the query (newest first, up to
`limit`); `/memories` appends. `failing = True` answers 503 to everything while the port stays open.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class FakeMemoryService:
    def __init__(self) -> None:
        self.stored: list[dict[str, Any]] = []
        self.recall_bodies: list[Any] = []
        self.save_bodies: list[Any] = []
        self.failing = False
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def url(self) -> str:
        if not self._port:
            raise RuntimeError("the service was never started")
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/recall", self._recall)
        app.router.add_post("/memories", self._save)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, reuse_address=True)
        await site.start()
        self._port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeMemoryService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _recall(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.recall_bodies.append(body)
        if self.failing:
            return web.json_response({"error": "unavailable"}, status=503)
        query = str(body.get("query", ""))
        limit = int(body.get("limit", 5))
        close = [item for item in reversed(self.stored) if set(query) & set(item["text"])]
        return web.json_response({"memories": close[:limit]})

    async def _save(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.save_bodies.append(body)
        if self.failing:
            return web.json_response({"error": "unavailable"}, status=503)
        self.stored.append(body)
        return web.json_response({"ok": True}, status=201)
