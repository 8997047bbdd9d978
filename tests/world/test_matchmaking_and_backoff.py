"""Matchmaking answers of both versions, websocket URLs, and the reconnection backoff."""

from __future__ import annotations

import itertools

import pytest

from bridge.backoff import Backoff
from bridge.errors import WorldAuthError, WorldProtocolError
from bridge.world.matchmaking import MatchmakingRefused, Seat, http_base, parse_seat, websocket_url


def test_018_answer_is_flat() -> None:
    seat = parse_seat(200, {"name": "world", "sessionId": "S1", "roomId": "R1", "processId": "P1"})
    assert seat == Seat(version="0.18", room_id="R1", process_id="P1", session_id="S1")


def test_016_answer_nests_the_room() -> None:
    body = {"room": {"name": "world", "roomId": "R1", "processId": "P1", "clients": 1}, "sessionId": "S1"}
    assert parse_seat(200, body) == Seat(version="0.16", room_id="R1", process_id="P1", session_id="S1")


@pytest.mark.parametrize(
    ("status", "body"),
    [(525, {"code": 525, "error": "onAuth failed"}), (200, {"code": 4215, "error": "onAuth failed"})],
)
def test_auth_failure_is_a_configuration_error(status: int, body: dict[str, object]) -> None:
    with pytest.raises(WorldAuthError):
        parse_seat(status, body)


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (524, {"code": 524, "error": "seat reservation expired."}, 524),
        (200, {"code": 4212, "error": 'room "x" has been disposed.'}, 4212),
        (520, {"code": 520, "error": "no handler"}, 520),
    ],
)
def test_other_matchmaking_errors_keep_their_code(status: int, body: dict[str, object], code: int) -> None:
    with pytest.raises(MatchmakingRefused) as caught:
        parse_seat(status, body)
    assert caught.value.code == code


def test_unrecognised_answer_is_a_protocol_error() -> None:
    with pytest.raises(WorldProtocolError):
        parse_seat(200, {"hello": 1})
    with pytest.raises(WorldProtocolError):
        parse_seat(200, ["not", "an", "object"])


def test_websocket_url_for_join_and_both_reconnections() -> None:
    seat = Seat(version="0.18", room_id="R1", process_id="P1", session_id="S1")
    assert websocket_url("http://127.0.0.1:2567", seat) == "ws://127.0.0.1:2567/P1/R1?sessionId=S1"
    assert (
        websocket_url("https://world.example/game/", seat, reconnection_token="T", skip_handshake=True)
        == "wss://world.example/game/P1/R1?sessionId=S1&reconnectionToken=T&skipHandshake=1"
    )
    assert (
        websocket_url("ws://127.0.0.1:2567", seat, reconnection_token="T")
        == "ws://127.0.0.1:2567/P1/R1?sessionId=S1&reconnectionToken=T"
    )
    assert http_base("ws://127.0.0.1:2567/") == "http://127.0.0.1:2567"


def test_public_address_replaces_host() -> None:
    seat = Seat(version="0.18", room_id="R", process_id="P", session_id="S", public_address="node1.example:443")
    assert websocket_url("https://lb.example", seat) == "wss://node1.example:443/P/R?sessionId=S"


def test_backoff_grows_with_full_jitter_up_to_the_cap() -> None:
    backoff = Backoff(base_seconds=0.5, cap_seconds=30.0, rand=lambda: 1.0)
    delays = [backoff.next_delay() for _ in range(10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    low = Backoff(rand=lambda: 0.0)
    assert low.next_delay() == 0.0


def test_backoff_resets_only_after_a_healthy_connection() -> None:
    backoff = Backoff(base_seconds=1.0, cap_seconds=100.0, healthy_after_seconds=60.0, rand=lambda: 1.0)
    for _ in range(4):
        backoff.next_delay()
    backoff.connection_ended(uptime_seconds=5.0)
    assert backoff.next_delay() == 16.0
    backoff.connection_ended(uptime_seconds=61.0)
    assert backoff.next_delay() == 1.0


def test_slow_delay_after_a_refused_token_stays_near_the_cap() -> None:
    values = itertools.cycle([0.0, 0.5, 1.0])
    backoff = Backoff(base_seconds=0.5, cap_seconds=30.0, rand=lambda: next(values))
    assert [backoff.slow_delay() for _ in range(3)] == [22.5, 26.25, 30.0]


def test_many_attempts_do_not_overflow() -> None:
    backoff = Backoff(rand=lambda: 1.0)
    for _ in range(5000):
        delay = backoff.next_delay()
    assert delay == 30.0
