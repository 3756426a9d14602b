"""The per-combination stages, in one table.

Each stage runs llama.cpp once per model x device x dequant in an isolated worker process
(qdiff.run, qdiff.worker) and leaves two files in its results folder: ``record.json`` (what
happened, always written, also on failure) and its data file. The workflow's rules, path
helpers and resources, the worker's modes, the failure path and the SLURM runtime all read
this table, so a new stage is one entry here, one worker mode and one ``use rule`` in
``workflow/rules/combinations.smk``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qdiff.labels import Combination

RECORD_FILE = "record.json"
COMBINATION_PATH = "{model}/{device}/{dequant}"  # Snakemake wildcards of a combination


@dataclass(frozen=True)
class Stage:
    name: str  # also the folder of its logs
    rule: str  # the Snakemake rule
    folder: str  # results folder of its records and data
    data_file: str  # written beside record.json
    mode: str  # qdiff.worker mode
    runtime_min: int  # SLURM runtime per job on CPU (profiles/slurm may raise it)
    doc: str

    def directory(self, combo: Combination) -> str:
        return f"{self.folder}/{combo.model}/{combo.device}/{combo.dequant}"

    def record(self, combo: Combination) -> str:
        return f"{self.directory(combo)}/{RECORD_FILE}"

    def data(self, combo: Combination) -> str:
        return f"{self.directory(combo)}/{self.data_file}"

    # wildcard patterns of the stage's rule
    @property
    def record_pattern(self) -> str:
        return f"{self.folder}/{COMBINATION_PATH}/{RECORD_FILE}"

    @property
    def data_pattern(self) -> str:
        return f"{self.folder}/{COMBINATION_PATH}/{self.data_file}"

    @property
    def log_pattern(self) -> str:
        return f"results/logs/{self.name}/{COMBINATION_PATH}.log"


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            name="run",
            rule="run_combination",
            folder="results/runs",
            data_file="logits.npy",
            mode="generate",
            runtime_min=240,
            doc="greedy generation from every prompt; first-step logits over the vocabulary",
        ),
        Stage(
            name="forced",
            rule="force_combination",
            folder="results/forced",
            data_file="forced.npz",
            mode="force",
            runtime_min=240,
            doc="teacher forcing along the teacher's greedy output (qdiff.forcing)",
        ),
        Stage(
            name="capture",
            rule="capture_combination",
            folder="results/capture",
            data_file="capture.npz",
            mode="capture",
            runtime_min=60,
            doc="named intermediate tensors of one forward pass (qdiff.localise)",
        ),
    )
}
RUN, FORCED, CAPTURE = STAGES["run"], STAGES["forced"], STAGES["capture"]


def stage_of_mode(mode: str) -> Stage:
    return next(s for s in STAGES.values() if s.mode == mode)
