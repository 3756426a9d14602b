"""Per rule: its jobs and the sum of their wall times, from a Snakemake log
(.snakemake/log/*.snakemake.log). Run: python3 docs/results/bench-epyc/rule-times.py LOG"""

import re
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3}\s+\d+ \d\d:\d\d:\d\d \d{4})\]")
RULE = re.compile(r"^(?:local)?rule (\w+):")
JOB = re.compile(r"^\s+jobid: (\d+)")
DONE = re.compile(r"^Finished jobid: (\d+)")

now = None
rule = None
started: dict[str, tuple[str, datetime]] = {}
seconds: dict[str, float] = defaultdict(float)
jobs: dict[str, int] = defaultdict(int)
for line in Path(sys.argv[1]).read_text().splitlines():
    if m := STAMP.match(line):
        now = datetime.strptime(re.sub(r"\s+", " ", m.group(1)), "%a %b %d %H:%M:%S %Y")
    elif m := RULE.match(line):
        rule = m.group(1)
    elif (m := JOB.match(line)) and rule and now:
        started[m.group(1)], rule = (rule, now), None
    elif (m := DONE.match(line)) and m.group(1) in started and now:
        name, began = started[m.group(1)]
        seconds[name] += (now - began).total_seconds()
        jobs[name] += 1
for name, total in sorted(seconds.items(), key=lambda item: -item[1]):
    print(f"{name:28s} {jobs[name]:3d} jobs {total:7.0f} s")
print(f"all rules' jobs together: {sum(seconds.values()):.0f} s")
