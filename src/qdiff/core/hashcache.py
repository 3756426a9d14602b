"""SHA-256 of files, remembered by their identity on disk.

Reruns follow content, not timestamps: when a file a job depends on is only touched, its
hash is recomputed (the cache entry no longer matches its identity) and comes out the same,
so nothing reruns. The identity includes the inode's change time (ctime), which every write,
rename and ``touch`` moves and which no program can set back, so bytes replaced behind
qdiff's back are hashed again even when their size and mtime were kept (``cp -p``). The
cache lives in ``.snakemake/qdiff/hashes.json``; losing it only costs time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_FILE = Path(".snakemake/qdiff/hashes.json")
CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _identity(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class HashCache:
    def __init__(self, cache_file: Path = CACHE_FILE) -> None:
        self.cache_file = cache_file
        try:
            self.entries: dict[str, dict[str, object]] = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def sha256(self, path: Path) -> str:
        """The file's SHA-256, hashed again only if its identity on disk changed."""
        path = path.resolve()
        entry = self.entries.get(str(path))
        if entry and entry.get("identity") == _identity(path):
            return str(entry["sha256"])
        digest = sha256_of(path)
        self.remember(path, digest)
        return digest

    def remember(self, path: Path, sha256: str) -> None:
        """Record ``sha256`` as the hash of ``path`` as it is now (its maker computed it)."""
        path = path.resolve()
        self.entries[str(path)] = {"identity": _identity(path), "sha256": sha256}
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.entries, indent=0))
        os.replace(tmp, self.cache_file)  # concurrent parses: the last one wins, no harm
        self.changed = False


def remember_made(path: Path, sha256: str | None) -> None:
    """In the shared cache, ``sha256`` as the hash of the file its maker has just put at
    ``path`` (None: nothing was made), so that the next check of its bytes need not hash it."""
    if sha256 is not None:
        cache = HashCache()
        cache.remember(path, sha256)
        cache.save()
