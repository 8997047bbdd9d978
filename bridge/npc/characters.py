"""Character files (characters/<id>.json): the persona, speech and rules of each NPC."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bridge.errors import ConfigError

BUILTIN_FALLBACK = "すみません、少々お待ちくださいね。"
BUILTIN_FALLBACK_EN = "Sorry, just a moment, please."


class _Part(BaseModel):
    # The world's own character file may carry more keys: keep them, ignore them.
    model_config = ConfigDict(extra="allow", frozen=True)


class Area(_Part):
    min_x: float = Field(alias="minX")
    max_x: float = Field(alias="maxX")
    min_z: float = Field(alias="minZ")
    max_z: float = Field(alias="maxZ")


class Serve(_Part):
    places: list[str] = Field(default_factory=list)
    item: str | None = None
    lines: list[str] = Field(default_factory=list)


class Greet(_Part):
    area: Area | None = None
    lines: list[str] = Field(default_factory=list)


class Staff(_Part):
    serve: Serve | None = None
    greet: Greet | None = None
    talk: str | None = None
    role: str = ""


class Example(_Part):
    input: str
    reply: str


class Speech(_Part):
    first_person: str = "私"
    style: str = "やわらかい丁寧語"
    examples: list[Example] = Field(default_factory=list)
    language: Literal["ja", "en"] = "ja"

    @model_validator(mode="before")
    @classmethod
    def _defaults_in_its_language(cls, data: Any) -> Any:
        # An English character that leaves these out should not be told to call itself 私.
        if isinstance(data, dict) and data.get("language") == "en":
            data = {"first_person": "I", "style": "soft and polite", **data}
        return data


class Voice(_Part):
    speaker: str | None = None


class LLMChoice(_Part):
    model: str | None = None
    lane: str | None = None


class MemoryChoice(_Part):
    backend: Literal["file", "shared"] = "file"
    extract: Literal["silence", "inline"] = "silence"


class Character(_Part):
    id: str = Field(pattern=r"^[a-z0-9-]+$", min_length=1)
    name: str = Field(min_length=1)
    persona: str = Field(min_length=1)
    speaker_name: str | None = None
    staff: Staff | None = None
    talk: str | None = None  # non-staff characters say `"talk": "worker"` at the top level
    speech: Speech = Field(default_factory=Speech)
    fallbacks: list[str] = Field(default_factory=list)
    banned: list[str] = Field(default_factory=list)
    voice: Voice = Field(default_factory=Voice)
    llm: LLMChoice = Field(default_factory=LLMChoice)
    memory: MemoryChoice = Field(default_factory=MemoryChoice)

    @model_validator(mode="after")
    def _inline_needs_lane(self) -> Character:
        if self.memory.extract == "inline" and not self.llm.lane:
            raise ValueError("memory.extract 'inline' needs llm.lane (a strong model on a lane)")
        return self

    @property
    def short_name(self) -> str:
        return self.speaker_name or self.name

    @property
    def voiced(self) -> bool:
        """Whether the bridge takes this character's talk (characters.md)."""
        if self.staff is not None and self.staff.talk is not None:
            return self.staff.talk == "worker"
        return self.talk == "worker"

    @property
    def role(self) -> str:
        return self.staff.role if self.staff else ""

    @property
    def fallback_lines(self) -> list[str]:
        builtin = BUILTIN_FALLBACK_EN if self.speech.language == "en" else BUILTIN_FALLBACK
        return [line for line in self.fallbacks if line.strip()] or [builtin]


_T = TypeVar("_T")


class Derived(Generic[_T]):
    """A value computed from a roster's voiced characters: when made, and again at every replace."""

    def __init__(self, build: Callable[[Mapping[str, Character]], _T], voiced: Mapping[str, Character]) -> None:
        self._build = build
        self.value = build(voiced)

    def rebuild(self, voiced: Mapping[str, Character]) -> None:
        self.value = self._build(voiced)


class Roster:
    """All loaded characters; `voiced` are the ones the bridge claims.

    One Roster is shared by every component; `replace` swaps its characters in place (a reload), so
    all of them see the new ones. What a reply needs from the whole cast (e.g. the other speakers'
    names) is a `derive`d value: computed at start and at each replace, never on the reply path.
    """

    def __init__(self, characters: Mapping[str, Character]) -> None:
        self._characters: dict[str, Character] = {}
        self._voiced: dict[str, Character] = {}
        self._derived: list[Derived[Any]] = []
        self.replace(characters)

    def replace(self, characters: Mapping[str, Character]) -> None:
        """Swap in a new set of characters and recompute every derived value."""
        everyone = dict(characters)
        self._characters, self._voiced = everyone, {cid: c for cid, c in everyone.items() if c.voiced}
        for derived in self._derived:
            derived.rebuild(self.voiced)

    def derive(self, build: Callable[[Mapping[str, Character]], _T]) -> Derived[_T]:
        """`build(voiced characters)` now and after every replace; read it as `.value`."""
        derived = Derived(build, self.voiced)
        self._derived.append(derived)
        return derived

    @property
    def characters(self) -> Mapping[str, Character]:
        return MappingProxyType(self._characters)

    @property
    def voiced(self) -> Mapping[str, Character]:
        return MappingProxyType(self._voiced)

    def get(self, npc_id: str) -> Character | None:
        return self._characters.get(npc_id)


def _describe(error: ValidationError) -> list[str]:
    """Every problem pydantic found, one `field.path: message` each."""
    return [
        f"{'.'.join(str(part) for part in problem['loc']) or '(file)'}: {problem['msg'].removeprefix('Value error, ')}"
        for problem in error.errors()
    ]


def load_character(path: Path) -> Character:
    """Read and validate one character file; a bad one raises ConfigError with a line for each problem.

    Paths in the lines are resolved against the working directory, so the operator sees which file.
    """
    shown = path.resolve()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"character file {shown}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"character file {shown}: cannot read: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ConfigError(f"character file {shown}: not JSON: {where}: {exc.msg}") from None
    try:
        character = Character.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(*(f"character file {shown}: {problem}" for problem in _describe(exc))) from None
    if character.id != path.stem:
        raise ConfigError(f"character file {shown}: id: {character.id!r} does not match the file name")
    return character


def load_roster(directory: Path) -> Roster:
    """Load every `*.json` in the characters directory; any invalid file stops start-up.

    Every file is read before giving up, and the ConfigError carries every problem of every file.
    """
    shown = directory.resolve()
    if not directory.is_dir():
        reason = "does not exist" if not directory.exists() else "is not a directory"
        raise ConfigError(f"NPC_BRIDGE_CHARACTERS_DIR: {shown} {reason}")
    characters: dict[str, Character] = {}
    problems: list[str] = []
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError as exc:
        raise ConfigError(f"NPC_BRIDGE_CHARACTERS_DIR: cannot read {shown}: {exc.strerror or exc}") from None
    for path in paths:
        try:
            character = load_character(path)
        except ConfigError as exc:
            problems.extend(exc.lines)
            continue
        characters[character.id] = character
    if problems:
        raise ConfigError(*problems)
    if not characters:
        raise ConfigError(f"NPC_BRIDGE_CHARACTERS_DIR: no character files (*.json) in {shown}")
    return Roster(characters)
