"""Files: ``write_atomic`` and an effect that writes a file, found again by content hash."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from .base import Effect, EffectRejected, Published


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace ``path`` with ``data`` so that no reader ever sees a partial file.

    Temp file in the same directory (same file system, so the rename is atomic),
    write, flush, fsync, ``os.replace``, then fsync the directory so the rename
    itself survives a power cut. On any error the temp file is removed.
    """
    target = Path(path)
    directory = target.parent
    raw = data.encode() if isinstance(data, str) else data
    mode = _mode_of(target)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _mode_of(target: Path) -> int:
    """Keep the permissions of the file being replaced; a new file gets rw-r--r--."""
    try:
        return target.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o644


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WriteFile(Effect):
    """Write a text file atomically (the whole file is replaced)."""

    name = "write_file"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def prepare(self, path: str, content: str) -> dict[str, Any]:
        """Write ``content`` to ``path`` (relative to the allowed root).

        Args:
            path: file path, relative to the root the effect was given
            content: the whole new content of the file
        """
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise EffectRejected(f"{path!r} is outside {self.root}")
        if target == self.root:
            raise EffectRejected(f"{path!r} names the root {self.root}, not a file in it")
        if target.is_dir():
            raise EffectRejected(f"{path!r} is a directory")
        return {"path": str(target), "content": content, "sha256": _sha256(content.encode())}

    async def publish(self, payload: Any, idem_key: str) -> Published:
        target = Path(payload["path"])
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, payload["content"])
        except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
            raise EffectRejected(f"cannot write {target}: {exc}") from exc
        return self._found(payload)

    async def lookup(self, payload: Any) -> Published | None:
        """The file is there with exactly this content: the write happened."""
        try:
            current = Path(payload["path"]).read_bytes()
        except OSError:
            return None
        return self._found(payload) if _sha256(current) == payload["sha256"] else None

    @staticmethod
    def _found(payload: Any) -> Published:
        path, sha = payload["path"], payload["sha256"]
        result = {"path": path, "sha256": sha, "bytes": len(payload["content"].encode())}
        return Published(remote_id=f"{path}#sha256:{sha[:16]}", result=result)
