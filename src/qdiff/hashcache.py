"""SHA-256 of files, remembered by their identity on disk.

Reruns follow content, not timestamps: when a file a job depends on is only touched, its
hash is recomputed (the cache entry no longer matches its mtime) and comes out the same, so
nothing reruns. The cache lives in ``.snakemake/qdiff/hashes.json``; losing it only costs
time.
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
        stat = path.stat()
        identity = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
        entry = self.entries.get(str(path))
        if entry and entry.get("identity") == identity:
            return str(entry["sha256"])
        digest = sha256_of(path)
        self.entries[str(path)] = {"identity": identity, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.entries, indent=0))
        os.replace(tmp, self.cache_file)  # concurrent parses: the last one wins, no harm
        self.changed = False
