"""The workflow's exit does not wait for Snakemake's scheduler timer (qdiff.workflow)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from snakemake.scheduling.job_scheduler import JobScheduler

from qdiff.workflow import end_scheduler_timers


def test_the_scheduler_s_own_timer_is_cancelled_and_no_other() -> None:
    before = set(threading.enumerate())
    # Snakemake's own code arms its timer, as its scheduler does on every pass
    JobScheduler._schedule_reevalutation(SimpleNamespace(_open_jobs=threading.Semaphore(0)), 60)
    (scheduler_timer,) = set(threading.enumerate()) - before
    assert isinstance(scheduler_timer, threading.Timer), "Snakemake's scheduler changed"
    other = threading.Timer(60, lambda: None)
    other.start()
    try:
        end_scheduler_timers()
        scheduler_timer.join(timeout=5)
        assert not scheduler_timer.is_alive()
        assert other.is_alive()
    finally:
        other.cancel()
