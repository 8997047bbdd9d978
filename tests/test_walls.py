"""The import walls (issue 11): which package of bridge/ may not import which, read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BRIDGE = Path(__file__).resolve().parent.parent / "bridge"
WALLS = {
    "world": ("npc", "llm", "memory"),
    "llm": ("npc", "memory", "world"),
    "memory": ("npc", "world"),
}


def imported(path: Path) -> set[str]:
    """Every module named by an import in `path` (relative imports resolved against bridge/)."""
    names: set[str] = set()
    package = ["bridge", *path.relative_to(BRIDGE).parent.parts]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(WALLS))
def test_a_package_does_not_import_across_its_wall(package: str) -> None:
    crossing = [
        f"{path.relative_to(BRIDGE.parent)} imports {name}"
        for path in sorted((BRIDGE / package).rglob("*.py"))
        for name in sorted(imported(path))
        if any(name == f"bridge.{other}" or name.startswith(f"bridge.{other}.") for other in WALLS[package])
    ]
    assert crossing == []


def test_the_check_reads_plain_and_from_imports() -> None:
    # The dispatcher imports npc/, llm/ and memory/: what the walls above would catch in world/.
    names = imported(BRIDGE / "npc" / "dispatcher.py")
    assert {"bridge.npc.characters.Roster", "bridge.llm.gate", "asyncio"} <= names
