"""Make a requantized or dequantized copy with llama_model_quantize (rules requantize_model,
dequantize_model)."""

from pathlib import Path

from qdiff.io import read_json, write_json
from qdiff.jobs import log_to, model_info
from qdiff.quant import quantize
from qdiff.sources import sha256_of

log_to(snakemake.log[0])
source, target = Path(snakemake.input.gguf), snakemake.params.target
gguf = Path(snakemake.output.gguf)
quantize(source, gguf, target, snakemake.threads)
parent = read_json(Path(snakemake.input.info))
origin = f"{target} of {parent['file']} (sha256 {parent['sha256']})"
write_json(Path(snakemake.output.info), model_info(gguf, sha256_of(gguf), origin))
