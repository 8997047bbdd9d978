"""A pass-through proxy in front of a real OpenAI-compatible server that stamps every streamed token.

Benchmark part 7 puts it between the daemon and llama.cpp to see, on the wall clock, when the model
sent each piece of a reply: the real model's "first sentence's last token" and the token after it,
side by side with when part 0 and the `npc:say` reached the world. It adds one loopback hop to each
chunk (well under a millisecond here), to the parts and the say alike.

Only what the bridge uses is forwarded: `GET /v1/models` and `POST /v1/chat/completions`.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from bridge.npc.sentences import END_MARKS


@dataclass
class Proxied:
    """One request: when it arrived, and each streamed text piece with when it passed (epoch seconds)."""

    arrived: float
    pieces: list[tuple[float, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.pieces)

    def first_sentence(self) -> tuple[float | None, float | None]:
        """When the piece holding the text's first end mark passed, and the piece after it (the one
        that shows nothing more belongs to that sentence), in seconds after the request arrived."""
        seen = ""
        for index, (at, text) in enumerate(self.pieces):
            seen += text
            if any(mark in seen.strip() for mark in END_MARKS + "."):
                after = self.pieces[index + 1][0] - self.arrived if index + 1 < len(self.pieces) else None
                return at - self.arrived, after
        return None, None


class StampingProxy:
    """`async with StampingProxy(upstream_url) as proxy:` → `proxy.url`, `proxy.requests`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.requests: list[Proxied] = []
        self.url = ""
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> StampingProxy:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._client.aclose()

    async def _models(self, request: web.Request) -> web.Response:
        upstream = await self._client.get(f"{self.upstream}/v1/models")
        return web.Response(status=upstream.status_code, body=upstream.content, content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        record = Proxied(arrived=time.time())
        self.requests.append(record)
        body = await request.read()
        async with self._client.stream(
            "POST", f"{self.upstream}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status_code,
                headers={"Content-Type": upstream.headers.get("content-type", "application/json")},
            )
            await response.prepare(request)
            decoder = codecs.getincrementaldecoder("utf-8")()
            pending = ""
            try:
                async for raw in upstream.aiter_raw():
                    await response.write(raw)
                    now = time.time()
                    pending += decoder.decode(raw)
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        text = _delta(line)
                        if text:
                            record.pieces.append((now, text))
                await response.write_eof()
            except (ConnectionResetError, ConnectionError):
                pass  # the bridge closed the stream once the line was complete: what it does
        return response


def _delta(line: str) -> str:
    """The text of one SSE `data:` line of a chat completion chunk ('' for anything else)."""
    if not line.startswith("data:"):
        return ""
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return ""
    try:
        data: Any = json.loads(payload)
        content = data["choices"][0]["delta"].get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ""
    return content if isinstance(content, str) else ""
