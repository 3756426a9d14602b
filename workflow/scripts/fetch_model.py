"""Fetch one configured model into resources/models/ (rule fetch_model)."""

import json
from pathlib import Path

from qdiff.io import write_json
from qdiff.jobs import log_to, model_info
from qdiff.sources import describe_source, fetch

log_to(snakemake.log[0])
params = json.loads(snakemake.params.source)
gguf = Path(snakemake.output.gguf)
sha256 = fetch(params["source"], gguf, params["sha256"])
write_json(Path(snakemake.output.info), model_info(gguf, sha256, describe_source(params["source"])))
