"""A real read-only file system for the tests: a read-only bind mount of a test folder.

Root can write any file whatever its mode, so ``chmod`` proves nothing for root; a
mount that is read-only refuses root too (EROFS). Mounting needs CAP_SYS_ADMIN: where
it is refused, the test is skipped saying why.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30, check=False)


@contextmanager
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``(folder, view)``: files written into ``folder`` are seen, read-only, in ``view``."""
    folder, view = tmp_path / "writable", tmp_path / "read-only"
    folder.mkdir()
    view.mkdir()
    bound = _mount("--bind", str(folder), str(view))
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount a folder here (needs CAP_SYS_ADMIN): {bound.stderr}")
    try:
        locked = _mount("-o", "remount,bind,ro", str(view))
        if locked.returncode != 0:
            pytest.skip(f"cannot remount a bind mount read-only here: {locked.stderr}")
        yield folder, view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True, timeout=30, check=True)
