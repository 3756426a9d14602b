# qdiff: why does the same GGUF model give different text on different devices?
# Entry point only: the rules live in workflow/rules/, the logic in src/qdiff/.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/runs.smk"
include: "workflow/rules/compare.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        REPORT_FILES,
