"""`npc-bridge memory forget <npc> --pending`, pending lines marked in `memory show`, and a memory
command on a disk that refuses the write."""

from __future__ import annotations

import json
from pathlib import Path

from tests.memory.tinydisk import tiny_disk
from tests.test_cli import MEMORY_FILE, bridge


def write_memory(directory: Path, **changes: object) -> Path:
    path = directory / "cafe-minori.json"
    path.write_text(json.dumps({**MEMORY_FILE, **changes}, ensure_ascii=False), encoding="utf-8")
    return path


def test_forget_pending_clears_the_pending_conversation_and_keeps_the_memories(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    pending = [
        {"player": "また来るね", "npc": "お待ちしています。", "at": "2026-10-06T12:00:00+09:00"},
        {"player": "", "npc": "コーヒーです。", "at": "2026-10-06T12:01:00+09:00"},
    ]
    path = write_memory(tmp_path / "memory", pending=pending)
    result = bridge(tmp_path, "memory", "forget", "cafe-minori", "--pending")
    assert result.returncode == 0, result.stderr
    assert "cafe-minori: forgot the pending conversation (2 lines)" in result.stdout
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["pending"] == []
    assert data["memories"] == MEMORY_FILE["memories"]


def test_memory_show_marks_every_pending_line_and_no_memory(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    pending = [
        {"player": "また来るね", "npc": "お待ちしています。", "at": "2026-10-06T12:00:00+09:00"},
        {"player": "", "npc": "コーヒーです。", "at": "2026-10-06T12:01:00+09:00"},
    ]
    write_memory(tmp_path / "memory", pending=pending)
    out = bridge(tmp_path, "memory", "show", "cafe-minori").stdout.splitlines()
    marked = [line for line in out if "[pending]" in line]
    assert [line.strip() for line in marked] == [
        "[pending] (2026-10-06 12:00) player: また来るね",
        "[pending] (2026-10-06 12:01) npc (event): コーヒーです。",
    ]
    assert not any("[pending]" in line for line in out if "ユーザー" in line)  # memories are not marked
    header = next(line for line in out if line.startswith("pending conversation:"))
    assert "not yet extracted" in header and "memory forget cafe-minori --pending" in header
    assert bridge(tmp_path, "memory", "forget", "cafe-minori", "--pending").returncode == 0
    assert "pending conversation: 0 lines" in bridge(tmp_path, "memory", "show", "cafe-minori").stdout


def test_forget_pending_goes_with_neither_a_number_nor_all(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    path = write_memory(tmp_path / "memory")
    for extra in (["2"], ["--all"]):
        result = bridge(tmp_path, "memory", "forget", "cafe-minori", "--pending", *extra)
        assert result.returncode == 2  # argparse: not allowed with
    assert json.loads(path.read_text(encoding="utf-8")) == MEMORY_FILE


def test_forget_on_a_read_only_disk_says_so_in_one_line_and_leaves_the_file(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "memory") as disk:
        path = write_memory(disk.path)
        disk.read_only()
        try:
            result = bridge(tmp_path, "memory", "forget", "cafe-minori", "--pending")
        finally:
            disk.writable()
        assert result.returncode == 1
        assert result.stderr.strip().count("\n") == 0 and "Read-only file system" in result.stderr
        assert "Traceback" not in result.stderr
        assert json.loads(path.read_text(encoding="utf-8")) == MEMORY_FILE
        assert disk.files() == ["cafe-minori.json"]
