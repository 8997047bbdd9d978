"""The walls between the packages of bridge/, read from the source (every import statement, also those
inside functions): world/ knows nothing of the NPCs, the model or memory; llm/ nothing of NPCs, memory or
the world; memory/ nothing of NPCs or the world. What they share lives at bridge/'s top level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BRIDGE = Path(__file__).resolve().parent.parent / "bridge"

WALLS: dict[str, tuple[str, ...]] = {
    "world": ("npc", "llm", "memory"),
    "llm": ("npc", "memory", "world"),
    "memory": ("npc", "world"),
}


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of every module a file of `package` imports (relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # `from bridge import npc` imports the package bridge.npc.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _imports_of(path: Path) -> set[str]:
    dotted = ".".join(path.relative_to(BRIDGE.parent).with_suffix("").parts[:-1])
    return imported_modules(path.read_text(encoding="utf-8"), dotted)


def _through_top_level(modules: set[str]) -> set[str]:
    """`modules` and what the top-level modules among them (bridge/X.py, shared by all) import, on and on:
    a wall crossed through a shared module is crossed all the same."""
    seen, todo = set(modules), list(modules)
    while todo:
        parts = todo.pop().split(".")
        path = BRIDGE / f"{parts[1]}.py" if len(parts) >= 2 and parts[0] == "bridge" else None
        if path is not None and path.is_file():
            new = _imports_of(path) - seen
            seen |= new
            todo.extend(new)
    return seen


def crossings(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((BRIDGE / package).rglob("*.py")):
        for module in sorted(_through_top_level(_imports_of(path))):
            parts = module.split(".")
            if len(parts) >= 2 and parts[0] == "bridge" and parts[1] in forbidden:
                out.append(f"{path.relative_to(BRIDGE.parent)} imports {module}")
    return out


def test_the_import_reader_sees_every_form_of_import() -> None:
    # A wall test that cannot see an import would pass for the wrong reason.
    source = (
        "import bridge.npc.a\n"
        "from bridge.npc.b import thing\n"
        "from bridge import npc\n"
        "from ..npc import c\n"
        "from . import d\n"
        "def later():\n"
        "    from bridge.world.e import f\n"
    )
    found = imported_modules(source, "bridge.memory")
    for module in ("bridge.npc.a", "bridge.npc.b", "bridge.npc", "bridge.npc.c", "bridge.memory.d", "bridge.world.e"):
        assert module in found, module
    # What a shared top-level module imports counts for its importer.
    assert "bridge.errors" in _through_top_level({"bridge.settings"})


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("world", WALLS["world"]),
        ("llm", WALLS["llm"]),
        ("memory", WALLS["memory"]),
    ],
)
def test_a_package_does_not_import_across_its_wall(package: str, forbidden: tuple[str, ...]) -> None:
    assert crossings(package, forbidden) == []
