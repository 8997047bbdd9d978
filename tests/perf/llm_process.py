"""Part 1's instant loopback LLM in a process of its own: `python -m tests.perf.llm_process`.

Its arrival stamps are the "LLM request arrival" of part 1, so they must not wait for the
benchmark's own work: in the benchmark's event loop they waited behind the injector's POSTs to the
world and the collector's pauses, and that wait was counted as the bridge's. A real model server
does not share a loop with the players either.

Prints its URL as the first line of stdout; `GET /bench/timings` gives every stamped request;
SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

from aiohttp import web

from tests.perf.support import TimedOllama, instant_answer


class StampingOllama(TimedOllama):
    """Instant: the whole streamed answer (its NDJSON lines of 4-character pieces and the final line)
    goes out in one write, as a model that has the answer ready would send it; one write also keeps
    this process's own work from delaying the next request's arrival stamp."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._held: dict[int, list[bytes]] = {}

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        timing = self._live.get(id(request))
        record = timing.record if timing is not None else None
        if record is not None and record.pieces_sent < record.pieces_planned:
            self._held.setdefault(id(request), []).append(data)
            return
        await super()._write(request, response, b"".join([*self._held.pop(id(request), []), data]))

    def _add_routes(self, app: web.Application) -> None:
        super()._add_routes(app)
        app.router.add_get("/bench/timings", self._timings)

    async def _timings(self, request: web.Request) -> web.Response:
        rows: list[dict[str, Any]] = [
            {"arrived": t.arrived, "tag": t.tag, "writes": t.writes, "extraction": t.extraction}
            for t in self.timings
        ]
        return web.json_response(rows)


async def main() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with StampingOllama(default=instant_answer([0]), piece_chars=4) as llm:
        # A short-lived process: no collector pauses in its stamps (what it keeps is bounded by the run).
        gc.collect()
        gc.freeze()
        gc.disable()
        print(llm.url, flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
