"""qdiff's GGUF reader (qdiff.core.gguffile) against gguf-py's GGUFReader on the default
experiment's files: seconds to read the metadata and tensor table (fastest of 3, each in a
fresh process) and the resident memory it adds. Run from the repository root after the
default experiment: .venv/bin/python docs/results/bench-epyc/gguf-reader.py"""

import subprocess
import sys
from pathlib import Path

FILES = sorted(Path("resources/models").glob("*.gguf"))
CHILD = """
import sys, time, resource
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
import gguf, numpy
from qdiff.core.gguffile import GGUFFile
before = rss()
start = time.perf_counter()
f = GGUFFile(sys.argv[2]) if sys.argv[1] == "qdiff" else gguf.GGUFReader(sys.argv[2])
n = len(f.fields), len(f.tensors)
print(time.perf_counter() - start, rss() - before)
"""

print("file, reader: seconds (fastest of 3), MiB added")
for path in FILES:
    for reader in ("qdiff", "gguf-py"):
        runs = [
            [
                float(v)
                for v in subprocess.run(
                    [sys.executable, "-c", CHILD, reader, str(path)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
            ]
            for _ in range(3)
        ]
        seconds, mib = min(r[0] for r in runs), max(r[1] for r in runs)
        print(f"{path.name}, {reader}: {seconds:.3f} s, {mib:.0f} MiB")
