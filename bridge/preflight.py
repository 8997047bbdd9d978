"""Start-up checks shared by `run` and `check`: what must hold before the daemon takes any work."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bridge.errors import ConfigError


def prepare_memory_dir(directory: Path) -> None:
    """Create the memory directory if needed and prove it takes a file; else one ConfigError line.

    Proving it by writing (not `os.access`) also catches a read-only file system, and root, which
    `os.access` always answers yes.
    """
    shown = directory.resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"NPC_BRIDGE_MEMORY_DIR: {shown} is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"NPC_BRIDGE_MEMORY_DIR: cannot create {shown}: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".npc-bridge-check-", delete=True):
            pass
    except OSError as exc:
        raise ConfigError(f"NPC_BRIDGE_MEMORY_DIR: {shown} is not writable: {exc.strerror or exc}") from None
