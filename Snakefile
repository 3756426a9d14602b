# qdiff: why does the same GGUF model give different text on different devices?
# Entry point only: the rules live in workflow/rules/, the logic in src/qdiff/.
from snakemake.utils import min_version

from qdiff.core.config import check_config_files

min_version("9.0")


report: "workflow/report/workflow.rst"


# The default experiment, unless the user names their own with --configfile: Snakemake would
# otherwise merge that file into this one, and a device could never be removed. Checked
# first: Snakemake runs a templated (YTE) config as code while it loads it.
if not workflow.overwrite_configfiles:
    check_config_files(["config/config.yaml"])

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/combinations.smk"
include: "workflow/rules/compare.smk"
include: "workflow/rules/exact.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        all_targets,
