"""Fallback lines (replies.md "Checks, regeneration, fallback"): prepared lines from the character file."""

from __future__ import annotations

from bridge.npc.characters import Character


class Fallbacks:
    """Rotates each character's fallback lines so the same one is never said twice in a row."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def next_line(self, character: Character) -> str:
        lines = character.fallback_lines
        index = self._next.get(character.id, 0) % len(lines)
        self._next[character.id] = index + 1
        return lines[index]
