"""A real, tiny tmpfs for disk-fault tests: fill it to the brim, remount it read-only, and back.

Mounting needs root (CI runs as root). Where `mount` is refused the tests are skipped with a loud
reason, never passed quietly.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SIZE = "256k"


class TinyDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / "filler"

    def fill(self) -> None:
        """Write a filler file until the disk says ENOSPC (so not one more page fits)."""
        chunk = b"\0" * 4096
        with self._filler.open("ab", buffering=0) as handle:
            while True:
                try:
                    handle.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        # A few bytes may still fit in a partly used page: take them too.
        with contextlib.suppress(OSError), self._filler.open("ab", buffering=0) as handle:
            while handle.write(b"\0"):
                pass

    def free(self) -> None:
        self._filler.unlink()

    def read_only(self) -> None:
        _mount("-o", "remount,ro", str(self.path))

    def writable(self) -> None:
        _mount("-o", "remount,rw", str(self.path))

    def files(self) -> list[str]:
        """What the disk holds besides the filler (leftover temporary files included)."""
        return sorted(p.name for p in self.path.iterdir() if p != self._filler)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def tiny_disk(where: Path) -> Iterator[TinyDisk]:
    where.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(where))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"SKIPPED LOUDLY: disk-fault tests need `mount -t tmpfs` (root): {detail.strip()}")
    try:
        yield TinyDisk(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
