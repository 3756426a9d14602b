"""The per-combination stages, in one table.

Each stage runs llama.cpp once per model x device x dequant in an isolated worker process
(qdiff.engine.stage, qdiff.engine.worker) and leaves two files in its results folder:
``record.json`` (what happened, always written, also on failure) and its data file. The
workflow's rules, path helpers and resources, the worker, the failure path, the SLURM runtime
and the report (its inputs, its view of a model, its table of failures) all read this table,
so a new stage is one entry here, its spec in qdiff.core.config, its function in
qdiff.engine.worker, one ``use rule`` in ``workflow/rules/combinations.smk`` and, if the report
is to show more than its failures, a module of qdiff.report.sections that its entry names. A stage has one name: its rule is
``<name>_combination``, its logs are under ``results/logs/<name>/``, its records say
``"stage": "<name>"`` and its worker function is ``STAGE_FUNCTIONS[<name>]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qdiff.core.labels import Combination

RECORD_FILE = "record.json"
COMBINATION_PATH = "{model}/{device}/{dequant}"  # Snakemake wildcards of a combination


@dataclass(frozen=True)
class Stage:
    name: str  # its one name (see above)
    folder: str  # results folder of its records and data
    data_file: str  # written beside record.json
    label: str  # what the report calls it, e.g. in the stages a failure cost
    runtime_min: int  # SLURM runtime per job on CPU (profiles/slurm may raise it)
    doc: str
    # its section in each model's part of the report: (heading, module of
    # qdiff.report.sections with a ``section(view)`` function), after the pairwise table
    section: tuple[str, str] | None = None

    @property
    def rule(self) -> str:
        return f"{self.name}_combination"

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
            folder="results/runs",
            data_file="logits.npy",
            label="run",
            runtime_min=240,
            doc="greedy generation from every prompt; first-step logits over the vocabulary",
        ),
        Stage(
            name="forced",
            folder="results/forced",
            data_file="forced.npz",
            label="teacher forcing",
            runtime_min=240,
            doc="teacher forcing along the teacher's greedy output (qdiff.compare.forced)",
            section=("Teacher-forced comparison", "forced"),
        ),
        Stage(
            name="capture",
            folder="results/capture",
            data_file="capture.npz",
            label="capture",
            runtime_min=60,
            doc="named intermediate tensors of one forward pass (qdiff.compare.localise)",
            section=("Where the pairs part: op by op", "localised"),
        ),
        Stage(
            name="serving",
            folder="results/serving",
            data_file="serving.npz",
            label="serving",
            runtime_min=120,
            doc="prompts decoded as a server would, against each alone (qdiff.core.serving)",
            section=("Serving conditions: which cases change the output", "serving"),
        ),
        Stage(
            name="text",
            folder="results/text",
            data_file="text.npz",
            label="text",
            runtime_min=120,
            doc="a real text scored in windows as llama-perplexity scores it (qdiff.core.text)",
            section=("A real text, scored as llama-perplexity scores it", "text"),
        ),
    )
}
RUN, FORCED, CAPTURE = STAGES["run"], STAGES["forced"], STAGES["capture"]
SERVING, TEXT = STAGES["serving"], STAGES["text"]
