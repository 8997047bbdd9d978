"""One list of chat-template markers: the reply cleaner and the extraction parser cut at every one of
them, and every stop string sent to the server is one of them."""

from __future__ import annotations

import pytest

from bridge.llm.base import GenerationRequest
from bridge.markers import TEMPLATE_CUT_MARKERS, TEMPLATE_STOP_STRINGS
from bridge.memory.extractor import parse_memories
from bridge.npc.cleaner import clean


@pytest.mark.parametrize("marker", TEMPLATE_CUT_MARKERS)
def test_a_reply_is_cut_at_every_template_marker(marker: str) -> None:
    raw = f"いらっしゃいませ。{marker}user\nこんにちは。"
    cleaned = clean(raw, own_names=["みのり"], other_speakers=[], max_sentences=3, max_chars=90)
    assert cleaned.text == "いらっしゃいませ。"


@pytest.mark.parametrize("marker", TEMPLATE_CUT_MARKERS)
def test_an_extraction_is_cut_at_every_template_marker(marker: str) -> None:
    answer = '{"memories": ["ユーザーは犬を飼っている。"]}'
    assert parse_memories(answer) == ["ユーザーは犬を飼っている。"]
    assert parse_memories(marker + answer) is None
    assert parse_memories(marker.lower() + answer) is None


def test_the_stop_strings_are_cut_markers_and_the_default_stop() -> None:
    assert set(TEMPLATE_STOP_STRINGS) <= set(TEMPLATE_CUT_MARKERS)
    request = GenerationRequest(messages=(), model="m", temperature=0.0, max_tokens=1, deadline_seconds=1.0)
    assert request.stop == TEMPLATE_STOP_STRINGS
