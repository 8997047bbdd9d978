"""The LLM slot: bounded, and a waiting reply goes before a waiting extraction."""

from __future__ import annotations

import asyncio

import pytest

from bridge.llm.gate import LLMGate, Priority


async def test_reply_waiting_after_an_extraction_is_served_first() -> None:
    gate = LLMGate(1)
    order: list[str] = []
    await gate.acquire(Priority.REPLY)  # something is generating

    async def job(name: str, priority: Priority) -> None:
        async with gate.slot(priority):
            order.append(name)

    extraction = asyncio.create_task(job("extraction", Priority.EXTRACTION))
    await asyncio.sleep(0)
    reply = asyncio.create_task(job("reply", Priority.REPLY))
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(extraction, reply)
    assert order == ["reply", "extraction"]


async def test_no_more_than_the_configured_requests_run_at_once() -> None:
    gate = LLMGate(2)
    running = 0
    peak = 0

    async def job() -> None:
        nonlocal running, peak
        async with gate.slot(Priority.REPLY):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1

    await asyncio.gather(*(job() for _ in range(7)))
    assert peak == 2


async def test_a_cancelled_waiter_does_not_leak_the_slot() -> None:
    gate = LLMGate(1)
    await gate.acquire(Priority.REPLY)
    waiter = asyncio.create_task(gate.acquire(Priority.REPLY))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.release()
    await asyncio.wait_for(gate.acquire(Priority.EXTRACTION), 1)


async def test_same_priority_is_first_come_first_served() -> None:
    gate = LLMGate(1)
    await gate.acquire(Priority.REPLY)
    order: list[int] = []

    async def job(n: int) -> None:
        async with gate.slot(Priority.REPLY):
            order.append(n)

    tasks = []
    for n in range(4):
        tasks.append(asyncio.create_task(job(n)))
        await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]
