"""Notice when a config file changes, for hot reload without inotify."""

from __future__ import annotations

import hashlib
from pathlib import Path


class FileWatcher:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, ...] | None = self._stat()
        self._digest = self._hash()

    def _stat(self) -> tuple[int, ...] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        # ctime and inode catch edits that keep size and mtime (cp -p, rsync -t, an
        # atomic rename, two writes within one timestamp tick).
        return stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_size

    def _hash(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def changed(self) -> bool:
        """True once per real change of content (touching the file is not a change)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        digest = self._hash()
        if digest == self._digest:
            return False
        self._digest = digest
        return True
