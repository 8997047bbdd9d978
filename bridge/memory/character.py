"""What the memory side reads of a character, as protocols: `memory/` does not import `npc/`.

`bridge.npc.characters.Roster` and `Character` satisfy them; the keeper is handed the roster.
"""

from __future__ import annotations

from typing import Literal, Protocol


class MemoryConfig(Protocol):
    @property
    def backend(self) -> Literal["file", "shared"]: ...

    @property
    def extract(self) -> Literal["silence", "inline"]: ...


class LLMConfig(Protocol):
    @property
    def model(self) -> str | None: ...

    @property
    def lane(self) -> str | None: ...


class SpeechConfig(Protocol):
    @property
    def language(self) -> Literal["ja", "en"]: ...


class MemoryCharacter(Protocol):
    @property
    def memory(self) -> MemoryConfig: ...

    @property
    def llm(self) -> LLMConfig: ...

    @property
    def speech(self) -> SpeechConfig: ...


class Characters(Protocol):
    """The characters by id (the roster)."""

    def get(self, npc_id: str) -> MemoryCharacter | None: ...
