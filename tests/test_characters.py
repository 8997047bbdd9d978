"""Character files: the shipped ones are valid; a bad one names its path and the field at fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bridge.errors import ConfigError
from bridge.npc.characters import BUILTIN_FALLBACK, load_character, load_roster

REPO = Path(__file__).resolve().parent.parent
MINIMAL: dict[str, Any] = {
    "id": "test-npc",
    "name": "テスト",
    "persona": "テスト用の店員。",
    "staff": {"talk": "worker", "role": "店の前に立っている。"},
}


def write(tmp_path: Path, data: dict[str, Any], name: str | None = None) -> Path:
    path = tmp_path / f"{name or data.get('id', 'x')}.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def test_shipped_characters_load_and_the_staff_are_voiced() -> None:
    roster = load_roster(REPO / "characters")
    assert {"cafe-minori", "cinema-aoi", "ryokan-fumi", "haruno"} <= set(roster.characters)
    for npc_id in ("cafe-minori", "cinema-aoi", "ryokan-fumi"):
        character = roster.characters[npc_id]
        assert character.voiced
        assert character.staff is not None and character.role
        assert character.fallbacks and character.speech.examples
    haruno = roster.characters["haruno"]
    assert haruno.staff is None and haruno.voiced
    assert haruno.memory.backend == "shared"


def test_minimal_character_gets_defaults(tmp_path: Path) -> None:
    character = load_character(write(tmp_path, MINIMAL))
    assert character.short_name == "テスト"
    assert character.fallback_lines == [BUILTIN_FALLBACK]
    assert character.memory.backend == "file" and character.memory.extract == "silence"
    assert character.llm.model is None


def test_unknown_keys_are_kept_and_ignored(tmp_path: Path) -> None:
    character = load_character(write(tmp_path, {**MINIMAL, "walkSpeed": 1.2}))
    assert character.model_extra == {"walkSpeed": 1.2}


def test_staff_with_another_talk_is_loaded_but_not_voiced(tmp_path: Path) -> None:
    data = {**MINIMAL, "staff": {"talk": "scripted"}}
    roster_dir = tmp_path / "chars"
    roster_dir.mkdir()
    write(roster_dir, data)
    roster = load_roster(roster_dir)
    assert "test-npc" in roster.characters and not roster.voiced


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"id": "Cafe_Minori"}, "id"),
        ({"name": ""}, "name"),
        ({"persona": None}, "persona"),
        ({"fallbacks": "not a list"}, "fallbacks"),
        ({"memory": {"backend": "cloud"}}, "memory.backend"),
        ({"memory": {"extract": "inline"}}, "inline"),
        ({"staff": {"talk": "worker", "greet": {"area": {"minX": "left"}}}}, "staff.greet.area"),
    ],
)
def test_invalid_field_is_reported_with_path_and_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    path = write(tmp_path, {**MINIMAL, **change}, name="test-npc")
    with pytest.raises(ConfigError) as caught:
        load_character(path)
    assert str(path) in str(caught.value)
    assert field in str(caught.value)


def test_missing_required_field_is_named(tmp_path: Path) -> None:
    data = {k: v for k, v in MINIMAL.items() if k != "persona"}
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=r"persona: Field required"):
        load_character(path)


def test_id_must_match_the_file_name(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL, name="other-name")
    with pytest.raises(ConfigError, match=r"does not match the file name"):
        load_character(path)


def test_broken_json_is_reported_with_its_position(tmp_path: Path) -> None:
    path = tmp_path / "test-npc.json"
    path.write_text('{"id": "test-npc",', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"test-npc.json: not JSON: line 1"):
        load_character(path)


def test_one_bad_file_stops_the_roster(tmp_path: Path) -> None:
    write(tmp_path, MINIMAL)
    write(tmp_path, {**MINIMAL, "id": "bad-one", "persona": ""})
    with pytest.raises(ConfigError, match=r"bad-one\.json"):
        load_roster(tmp_path)


def test_empty_directory_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NPC_BRIDGE_CHARACTERS_DIR"):
        load_roster(tmp_path)
