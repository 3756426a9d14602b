# The per-combination stages (qdiff.core.stages): one job per model x device x dequant and stage,
# each running llama.cpp in an isolated child process, so a crash becomes a "failed" record.
# One rule body; the other stages are derived from it and differ only in what they read and
# write. A stage's own rule means changing its settings never reruns the others.
# No benchmark: Snakemake's sampler reads each process's memory map twice a second, which
# slowed the inference it watched; each record times its own job (qdiff.engine.stage.job_usage).


rule run_combination:
    input:
        unpack(combination_inputs),
    output:
        **stage_outputs(RUN),
    log:
        RUN.log_pattern,
    conda:
        run_env
    threads: run_threads
    resources:
        **stage_resources(RUN),
    params:
        stage=RUN.name,
        spec=stage_spec(RUN),
        llama_build=LLAMA_BUILD,
        code=CODE["combination_stage"],
        retry_token=stage_retry_token(RUN),
    script:
        "../scripts/combination_stage.py"


# Teacher forcing (qdiff.compare.forced): every combination fed the teacher's greedy output.
use rule run_combination as forced_combination with:
    input:
        unpack(forced_inputs),
    output:
        **stage_outputs(FORCED),
    log:
        FORCED.log_pattern,
    resources:
        **stage_resources(FORCED),
    params:
        stage=FORCED.name,
        spec=stage_spec(FORCED),
        llama_build=LLAMA_BUILD,
        code=CODE["combination_stage"],
        retry_token=stage_retry_token(FORCED),


# Tensor capture (qdiff.compare.localise): the named intermediate tensors of one forward pass.
use rule run_combination as capture_combination with:
    output:
        **stage_outputs(CAPTURE),
    log:
        CAPTURE.log_pattern,
    resources:
        **stage_resources(CAPTURE),
    params:
        stage=CAPTURE.name,
        spec=stage_spec(CAPTURE),
        llama_build=LLAMA_BUILD,
        code=CODE["combination_stage"],
        retry_token=stage_retry_token(CAPTURE),


# Serving conditions (qdiff.core.serving): prompts decoded as a server would, against each alone.
use rule run_combination as serving_combination with:
    input:
        unpack(serving_inputs),
    output:
        **stage_outputs(SERVING),
    log:
        SERVING.log_pattern,
    resources:
        **stage_resources(SERVING),
    params:
        stage=SERVING.name,
        spec=stage_spec(SERVING),
        llama_build=LLAMA_BUILD,
        code=CODE["combination_stage"],
        retry_token=stage_retry_token(SERVING),


# A real text (qdiff.core.text): its windows scored as llama-perplexity scores them.
use rule run_combination as text_combination with:
    input:
        unpack(text_inputs),
    output:
        **stage_outputs(TEXT),
    log:
        TEXT.log_pattern,
    resources:
        **stage_resources(TEXT),
    params:
        stage=TEXT.name,
        spec=stage_spec(TEXT),
        llama_build=LLAMA_BUILD,
        code=CODE["combination_stage"],
        retry_token=stage_retry_token(TEXT),
