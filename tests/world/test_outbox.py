"""The outbox: says and parts kept while disconnected, in one order, bounded by replies, fresh per reply."""

from __future__ import annotations

from structlog.testing import capture_logs

from bridge.world.messages import Say, SayPart
from bridge.world.outbox import Outbox


def _say(reply_to: str) -> Say:
    return Say(npc_id="cafe-minori", reply_to=reply_to, text="はい。いいですよ。")


def _part(reply_to: str, index: int) -> SayPart:
    return SayPart(npc_id="cafe-minori", reply_to=reply_to, index=index, text="はい。")


def _drain(outbox: Outbox) -> list[tuple[str, str, int | None]]:
    out = []
    while (kept := outbox.next_fresh()) is not None:
        message = kept.message
        out.append((message.type_name, message.reply_to, message.index if isinstance(message, SayPart) else None))
        outbox.sent(kept)
    return out


def test_parts_and_says_leave_in_the_order_they_were_kept() -> None:
    outbox = Outbox(clock=lambda: 0.0, max_age_seconds=60, max_replies=10)
    for message in (_part("a", 0), _part("b", 0), _part("a", 1), _say("a"), _say("b")):
        outbox.keep(message)
    assert _drain(outbox) == [
        ("npc:say:part", "a", 0),
        ("npc:say:part", "b", 0),
        ("npc:say:part", "a", 1),
        ("npc:say", "a", None),
        ("npc:say", "b", None),
    ]
    assert len(outbox) == 0


def test_the_bound_counts_replies_and_drops_the_oldest_reply_whole() -> None:
    outbox = Outbox(clock=lambda: 0.0, max_age_seconds=60, max_replies=2)
    with capture_logs() as logs:
        for message in (_part("a", 0), _part("a", 1), _say("a"), _part("b", 0), _say("b"), _say("c")):
            outbox.keep(message)
    assert _drain(outbox) == [("npc:say:part", "b", 0), ("npc:say", "b", None), ("npc:say", "c", None)]
    dropped = [(e["reason"], e["reply_to"], e.get("parts")) for e in logs if e["event"] == "world_say_dropped"]
    assert dropped == [("buffer_full", "a", 2)]


def test_a_stale_reply_goes_with_all_its_parts_even_if_its_say_is_younger() -> None:
    now = [0.0]
    outbox = Outbox(clock=lambda: now[0], max_age_seconds=60, max_replies=10)
    outbox.keep(_part("old", 0))
    now[0] = 30.0
    outbox.keep(_say("old"))
    outbox.keep(_say("fresh"))
    now[0] = 61.0
    with capture_logs() as logs:
        assert _drain(outbox) == [("npc:say", "fresh", None)]
    assert [(e["reason"], e["reply_to"], e["age_s"]) for e in logs if e["event"] == "world_say_dropped"] == [
        ("stale", "old", 61.0)
    ]


def test_drop_parts_keeps_the_says() -> None:
    outbox = Outbox(clock=lambda: 0.0, max_age_seconds=60, max_replies=10)
    for message in (_part("a", 0), _part("a", 1), _say("a"), _part("b", 0)):
        outbox.keep(message)
    assert outbox.drop_parts() == 3
    assert _drain(outbox) == [("npc:say", "a", None)]


def test_said_replies_are_remembered() -> None:
    outbox = Outbox(clock=lambda: 0.0, max_age_seconds=60, max_replies=10)
    assert not outbox.said("a")
    outbox.mark_said("a")
    assert outbox.said("a") and not outbox.said("b")
