"""What the Snakefile runs in Snakemake's own process, beside the rules."""

from __future__ import annotations

import threading


def end_scheduler_timers() -> None:
    """Cancel the timers Snakemake's scheduler has left (its job rate limit,
    ``--max-jobs-per-timespan``, re-arms a 1 s ``threading.Timer`` on every pass). Python
    waits for them at exit, so without this every run that ran jobs ended about a second
    after its last job. Called by the workflow's onsuccess and onerror handlers."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer) and getattr(
            thread.function, "__module__", ""
        ).startswith("snakemake."):
            thread.cancel()
