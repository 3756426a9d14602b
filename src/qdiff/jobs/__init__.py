"""The harness every workflow script runs in (``harness.run``), the processes it supervises
(``processes``) and the limits it checks (``limits``). The names scripts use are here."""

from qdiff.jobs.harness import (
    CLAIMS_DIR,
    INPUTS_KEY,
    Claim,
    Job,
    StageError,
    StopWorkflow,
    empty_placeholder,
    error_info,
    inputs_key,
    run,
    staging_path,
)
from qdiff.jobs.limits import available_memory, disk_full
from qdiff.jobs.processes import (
    can_fork,
    child_outcome,
    child_preexec,
    console,
    die_with_workflow,
    fork,
    log_to,
    skip_exit_collection,
    spawn,
)

__all__ = [
    "CLAIMS_DIR",
    "INPUTS_KEY",
    "Claim",
    "Job",
    "StageError",
    "StopWorkflow",
    "available_memory",
    "can_fork",
    "child_outcome",
    "child_preexec",
    "console",
    "die_with_workflow",
    "disk_full",
    "empty_placeholder",
    "error_info",
    "fork",
    "inputs_key",
    "log_to",
    "run",
    "skip_exit_collection",
    "spawn",
    "staging_path",
]
