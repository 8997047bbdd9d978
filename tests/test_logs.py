"""Logs: one JSON object a line with event, level, UTC timestamp and bound context; no token, no text."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime

import pytest
import structlog

from bridge import logs


@pytest.fixture
def output() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    structlog.contextvars.clear_contextvars()
    logs.configure(fmt="json", level="info")


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_every_line_has_event_level_and_utc_iso_timestamp(output: io.StringIO) -> None:
    logs.configure(fmt="json", level="info", stream=output)
    structlog.get_logger("t").info("reply_said", latency_ms=12.5)
    (line,) = lines(output)
    assert line["event"] == "reply_said" and line["level"] == "info" and line["latency_ms"] == 12.5
    stamp = datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))
    assert stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_bound_context_appears_on_each_line(output: io.StringIO) -> None:
    logs.configure(fmt="json", level="info", stream=output)
    logs.bind(npc="cafe-minori", player="sess-1", event_id="evt-9")
    structlog.get_logger("t").info("talk_queued")
    (line,) = lines(output)
    assert (line["npc"], line["player"], line["event_id"]) == ("cafe-minori", "sess-1", "evt-9")


def test_player_and_npc_text_only_when_content_logging_is_on(output: io.StringIO) -> None:
    logs.configure(fmt="json", level="info", stream=output, log_content=False)
    structlog.get_logger("t").info("reply_said", player_text="紅茶が好き", npc_text="いいですね", chars=5)
    logs.configure(fmt="json", level="info", stream=output, log_content=True)
    structlog.get_logger("t").info("reply_said", player_text="紅茶が好き", npc_text="いいですね", chars=5)
    off, on = lines(output)
    assert "player_text" not in off and "npc_text" not in off and off["chars"] == 5
    assert on["player_text"] == "紅茶が好き" and on["npc_text"] == "いいですね"


def test_token_never_reaches_a_log_line(output: io.StringIO) -> None:
    token = "w0rld-t0ken-XYZ"
    logs.configure(fmt="json", level="debug", stream=output, secrets=[token])
    log = structlog.get_logger("t")
    log.info("joining", options={"token": token, "worker": True})
    log.warning("refused", url=f"http://world/?t={token}")
    logging.getLogger("websockets.client").warning("library said %s", token)
    try:
        raise RuntimeError(f"auth failed for {token}")
    except RuntimeError:
        log.exception("crashed")
    text = output.getvalue()
    assert token not in text
    assert text.count(logs.REDACTED) >= 4
    assert len(lines(output)) == 4


def test_library_logs_go_through_the_same_json_format(output: io.StringIO) -> None:
    logs.configure(fmt="json", level="info", stream=output)
    logging.getLogger("httpx").warning("connection pool full")
    (line,) = lines(output)
    assert line["event"] == "connection pool full" and line["logger"] == "httpx" and "timestamp" in line


def test_console_format_is_not_json(output: io.StringIO) -> None:
    logs.configure(fmt="console", level="info", stream=output)
    structlog.get_logger("t").info("hello_console")
    assert "hello_console" in output.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.getvalue().splitlines()[0])


def test_throttle_lets_a_burst_through_then_counts_until_the_next_window() -> None:
    now = [0.0]
    throttle = logs.Throttle(burst=3, window_seconds=60.0, clock=lambda: now[0])
    assert [throttle.admit("bad_frame") for _ in range(5)] == [0, 0, 0, None, None]
    assert throttle.admit("invalid") == 0  # each key has its own window
    now[0] = 59.9
    assert throttle.admit("bad_frame") is None
    now[0] = 60.0
    assert throttle.admit("bad_frame") == 3  # the next line says how many were not logged
    assert throttle.admit("bad_frame") == 0


class _GoneReader(io.StringIO):
    """A stdout whose reader has gone: every write is a broken pipe."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_stdout_drops_and_counts_lines_and_never_raises(capfd: pytest.CaptureFixture[str]) -> None:
    stream = logs.SafeStream(_GoneReader())
    logs.configure(fmt="json", level="info", stream=stream)  # type: ignore[arg-type]
    log = structlog.get_logger("t")
    for n in range(5):
        log.info("reply_said", n=n)
    logging.getLogger("httpx").warning("a library line")  # the standard library's path too
    assert stream.dropped == 6
    stream.close()
    reports = capfd.readouterr().err.splitlines()
    # Once at the first drop, then (within the minute) only the final count at exit.
    assert reports == [
        "npc-bridge: stdout failed (BrokenPipeError: Broken pipe): 1 log lines dropped so far",
        "npc-bridge: stdout failed (BrokenPipeError: Broken pipe): 6 log lines dropped so far",
    ]


def test_a_closed_stdout_is_counted_from_the_start(capfd: pytest.CaptureFixture[str]) -> None:
    stream = logs.SafeStream(None)
    stream.write('{"event": "x"}\n')
    stream.flush()
    assert stream.dropped == 1 and not stream.isatty()
    assert capfd.readouterr().err == "npc-bridge: stdout is closed: 1 log lines dropped so far\n"


CONTENT_LINES = [
    ("talk_queued", {"player_text": "紅茶が好き"}),
    ("reply_said", {"player_text": "紅茶が好き", "npc_text": "いいですね", "recalled": ["ユーザーは紅茶が好き"]}),
    ("reply_attempt", {"raw": "[happy]いいですね<end_of_turn>"}),
    ("memory_rejected", {"text": "ユーザーは眠い"}),
    ("memory_replaced", {"text": "ユーザーは猫を飼っている、名前はモチ", "replaced": "ユーザーは猫を飼っている"}),
    ("shared_memory_saved", {"text": "ユーザーは紅茶が好き"}),
]


@pytest.mark.parametrize(("event", "content"), CONTENT_LINES)
def test_the_one_content_gate_drops_what_was_said_unless_content_logging_is_on(
    output: io.StringIO, event: str, content: dict[str, object]
) -> None:
    # Code logs content under these keys and never checks the setting itself: this filter is the gate.
    logs.configure(fmt="json", level="debug", stream=output, log_content=False)
    structlog.get_logger("t").info(event, npc="cafe-minori", **content)
    logs.configure(fmt="json", level="debug", stream=output, log_content=True)
    structlog.get_logger("t").info(event, npc="cafe-minori", **content)
    off, on = lines(output)
    assert not set(content) & set(off) and off["npc"] == "cafe-minori"
    assert all(on[key] == value for key, value in content.items())
