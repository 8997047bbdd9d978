"""Every operator error is one plain line on stderr, exit code 2, no traceback — for `run` and `check`
alike — and what is not an error (a typo'd name) is a warning that names the closest real setting."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon import BRIDGE, REPO, bridge_env

TOKEN = "operator-token-1f2e"
# Nothing listens here: `check` finds the peers unreachable, `run` never gets that far.
NOWHERE = "http://127.0.0.1:9"


def run(tmp_path: Path, *args: str, **values: str) -> subprocess.CompletedProcess[str]:
    env = bridge_env(tmp_path / "memory", NPC_BRIDGE_WORLD_URL=NOWHERE, NPC_BRIDGE_LLM_URL=NOWHERE, **values)
    env.pop("CREDENTIALS_DIRECTORY", None)
    env["PYTHONPATH"] = str(REPO)  # run from tmp_path (relative paths), this checkout's code
    return subprocess.run(
        [*BRIDGE, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )


def assert_config_error(result: subprocess.CompletedProcess[str], lines: list[str]) -> None:
    assert result.returncode == 2, result.stderr + result.stdout
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"npc-bridge: configuration error: {line}" for line in lines]


def assert_check_fails_with(result: subprocess.CompletedProcess[str], lines: list[str]) -> None:
    """`check` reports the same problems, and exits 2 like `run`."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for line in lines:
        assert f"  FAIL  {line}" in result.stdout.splitlines()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs: not writable, even for root (CI runs as root)."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: cannot mount a read-only tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)


# (name, set-up(tmp_path) -> settings, the lines expected)
Case = Callable[[Path], tuple[dict[str, str], list[str]]]


def memory_dir_uncreatable(tmp: Path) -> tuple[dict[str, str], list[str]]:
    (tmp / "a-file").write_text("", encoding="utf-8")
    return (
        {"NPC_BRIDGE_MEMORY_DIR": "a-file/memory"},
        [f"NPC_BRIDGE_MEMORY_DIR: cannot create {tmp}/a-file/memory: Not a directory"],
    )


def memory_dir_is_a_file(tmp: Path) -> tuple[dict[str, str], list[str]]:
    (tmp / "a-file").write_text("", encoding="utf-8")
    return {"NPC_BRIDGE_MEMORY_DIR": "a-file"}, [f"NPC_BRIDGE_MEMORY_DIR: {tmp}/a-file is not a directory"]


def characters_dir_missing(tmp: Path) -> tuple[dict[str, str], list[str]]:
    return (
        {"NPC_BRIDGE_CHARACTERS_DIR": "no-such-dir"},
        [f"NPC_BRIDGE_CHARACTERS_DIR: {tmp}/no-such-dir does not exist"],
    )


def character_files_broken(tmp: Path) -> tuple[dict[str, str], list[str]]:
    characters = tmp / "characters"
    shutil.copytree(REPO / "characters", characters)
    # Two files, two problems each: every one of them is reported, not the first.
    (characters / "cafe-minori.json").write_text(json.dumps({"id": "cafe-minori", "name": ""}), encoding="utf-8")
    aoi = json.loads((characters / "cinema-aoi.json").read_text(encoding="utf-8"))
    aoi["memory"] = {"backend": "cloud", "extract": "never"}
    (characters / "cinema-aoi.json").write_text(json.dumps(aoi), encoding="utf-8")
    (characters / "haruno.json").write_text("{not json", encoding="utf-8")
    minori, aoi_path, haruno = (
        f"character file {characters}/{name}.json" for name in ("cafe-minori", "cinema-aoi", "haruno")
    )
    return (
        {"NPC_BRIDGE_CHARACTERS_DIR": "characters"},
        [
            f"{minori}: name: String should have at least 1 character",
            f"{minori}: persona: Field required",
            f"{aoi_path}: memory.backend: Input should be 'file' or 'shared'",
            f"{aoi_path}: memory.extract: Input should be 'silence' or 'inline'",
            f"{haruno}: not JSON: line 1 column 2: Expecting property name enclosed in double quotes",
        ],
    )


def token_file_unreadable(tmp: Path) -> tuple[dict[str, str], list[str]]:
    return (
        {"NPC_BRIDGE_WORLD_TOKEN": "", "NPC_BRIDGE_WORLD_TOKEN_FILE": "secrets/token"},
        [f"NPC_BRIDGE_WORLD_TOKEN_FILE: cannot read {tmp}/secrets/token: No such file or directory"],
    )


def credential_unreadable(tmp: Path) -> tuple[dict[str, str], list[str]]:
    (tmp / "credentials" / "world-token").mkdir(parents=True)
    return (
        {"NPC_BRIDGE_WORLD_TOKEN": "", "CREDENTIALS_DIRECTORY": str(tmp / "credentials")},
        [f"$CREDENTIALS_DIRECTORY/world-token: cannot read {tmp}/credentials/world-token: Is a directory"],
    )


def config_file_unreadable(tmp: Path) -> tuple[dict[str, str], list[str]]:
    return (
        {"NPC_BRIDGE_CONFIG": "bridge.toml"},
        [f"NPC_BRIDGE_CONFIG: cannot read {tmp}/bridge.toml: No such file or directory"],
    )


CASES: dict[str, Case] = {
    "memory directory uncreatable": memory_dir_uncreatable,
    "memory directory is a file": memory_dir_is_a_file,
    "characters directory missing": characters_dir_missing,
    "every problem of every character file": character_files_broken,
    "token file unreadable": token_file_unreadable,
    "systemd credential unreadable": credential_unreadable,
    "config file unreadable": config_file_unreadable,
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_operator_error_is_one_plain_line_each_and_exit_2_for_run_and_check(tmp_path: Path, case: str) -> None:
    values, lines = CASES[case](tmp_path)
    values = {"NPC_BRIDGE_WORLD_TOKEN": TOKEN, **values}
    from_credentials = "CREDENTIALS_DIRECTORY" in values
    if from_credentials:
        credentials = values.pop("CREDENTIALS_DIRECTORY")
        result = _with_credentials(tmp_path, credentials, "run", **values)
    else:
        result = run(tmp_path, "run", **values)
    assert_config_error(result, lines)
    if case == "config file unreadable":
        # Settings cannot even be read: `check` stops on the same line.
        assert_config_error(run(tmp_path, "check", **values), lines)
    elif from_credentials:
        assert_check_fails_with(_with_credentials(tmp_path, credentials, "check", **values), lines)
    else:
        assert_check_fails_with(run(tmp_path, "check", **values), lines)


def _with_credentials(tmp_path: Path, credentials: str, *args: str, **values: str) -> subprocess.CompletedProcess[str]:
    env = bridge_env(
        tmp_path / "memory",
        NPC_BRIDGE_WORLD_URL=NOWHERE,
        NPC_BRIDGE_LLM_URL=NOWHERE,
        CREDENTIALS_DIRECTORY=credentials,
        **values,
    )
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [*BRIDGE, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )


def test_memory_directory_not_writable_is_one_line_and_exit_2(tmp_path: Path, read_only_dir: Path) -> None:
    line = f"NPC_BRIDGE_MEMORY_DIR: {read_only_dir} is not writable: Read-only file system"
    values = {"NPC_BRIDGE_WORLD_TOKEN": TOKEN, "NPC_BRIDGE_MEMORY_DIR": str(read_only_dir)}
    assert_config_error(run(tmp_path, "run", **values), [line])
    assert_check_fails_with(run(tmp_path, "check", **values), [line])


def test_check_exits_1_when_only_a_peer_is_unreachable(tmp_path: Path) -> None:
    result = run(tmp_path, "check", NPC_BRIDGE_WORLD_TOKEN=TOKEN)
    assert result.returncode == 1, result.stdout
    assert f"  FAIL  world {NOWHERE} unreachable" in result.stdout


def test_a_mistyped_variable_is_a_warning_with_the_closest_name(tmp_path: Path) -> None:
    result = run(tmp_path, "check", NPC_BRIDGE_WORLD_TOKEN=TOKEN, NPC_BRIDGE_LLM_BACKND="openai")
    assert (
        "  warn  NPC_BRIDGE_LLM_BACKND is not a setting; did you mean NPC_BRIDGE_LLM_BACKEND?"
        in result.stdout.splitlines()
    )
    assert result.returncode == 1  # only the unreachable peers count


def test_run_logs_a_mistyped_variable_at_start(tmp_path: Path) -> None:
    env = bridge_env(
        tmp_path / "memory",
        NPC_BRIDGE_WORLD_URL=NOWHERE,
        NPC_BRIDGE_LLM_URL=NOWHERE,
        NPC_BRIDGE_WORLD_TOKEN=TOKEN,
        NPC_BRIDGE_LLM_BACKND="openai",
    )
    proc = subprocess.Popen([*BRIDGE, "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    assert first["event"] == "setting_unknown" and first["level"] == "warning"
    assert first["problem"] == "NPC_BRIDGE_LLM_BACKND is not a setting; did you mean NPC_BRIDGE_LLM_BACKEND?"
