"""Types the reply path shares with the world link: what a spoken line carries besides its text."""

from __future__ import annotations

from typing import Literal

# The VRM expression presets a world can show (world-protocol.md "Speaking").
Emotion = Literal["neutral", "happy", "angry", "sad", "relaxed", "surprised"]
# How a spoken line was made: first try, second try after a failed check, or a prepared line.
ReplySource = Literal["generated", "regenerated", "fallback"]
