"""SHA-256 of files, remembered by their identity on disk.

Reruns follow content, not timestamps: when a file a job depends on is only touched, its
hash is recomputed (the cache entry no longer matches its identity) and comes out the same,
so nothing reruns. The identity includes the inode's change time (ctime), which every write,
rename and ``touch`` moves and which no program can set back, so bytes replaced behind
qdiff's back are hashed again even when their size and mtime were kept (``cp -p``). The
cache lives in ``.snakemake/qdiff/hashes.json``; losing it only costs time.
"""

from __future__ import annotations

import fcntl
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
    """The cache file, read once; ``save`` merges what this process learnt into the file as
    it is then, under a lock, so that jobs saving at once lose none of each other's
    entries (a lost entry costs a file's hashing at the next invocation)."""

    def __init__(self, cache_file: Path = CACHE_FILE) -> None:
        self.cache_file = cache_file
        self.entries = _read(cache_file)
        self.learnt: dict[str, dict[str, object]] = {}

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
        entry: dict[str, object] = {"identity": _identity(path), "sha256": sha256}
        self.entries[str(path)] = self.learnt[str(path)] = entry

    def save(self) -> None:
        if not self.learnt:
            return
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        lock = self.cache_file.with_name(f".{self.cache_file.name}.lock")
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            merged = {**_read(self.cache_file), **self.learnt}
            tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged, indent=0))
            os.replace(tmp, self.cache_file)
        self.entries.update(merged)
        self.learnt = {}


def _read(cache_file: Path) -> dict[str, dict[str, object]]:
    try:
        entries = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def remember_made(path: Path, sha256: str | None) -> None:
    """In the shared cache, ``sha256`` as the hash of the file its maker has just put at
    ``path`` (None: nothing was made), so that the next check of its bytes need not hash it."""
    if sha256 is not None:
        cache = HashCache()
        cache.remember(path, sha256)
        cache.save()
