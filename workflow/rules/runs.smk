# One job per model x device x dequant: all prompts share one model load.
# The job runs inference in a child process, so a llama.cpp crash becomes a "failed" record.


rule run_combination:
    input:
        model=run_model,
        info=run_model_info,
    output:
        record="results/runs/{model}/{device}/{dequant}/record.json",
        data="results/runs/{model}/{device}/{dequant}/logits.npy",
    log:
        "results/logs/run/{model}/{device}/{dequant}.log",
    benchmark:
        "results/benchmarks/run/{model}/{device}/{dequant}.tsv"
    conda:
        run_env
    threads: run_threads
    resources:
        gpu=run_gpus,
        mem_mb=model_mem_mb,
    params:
        spec=run_spec,
        llama_build=LLAMA_BUILD,
        format=RECORD_FORMAT,
        retry_token=run_retry_token,
    script:
        "../scripts/run_combination.py"


# Teacher forcing (qdiff.forcing): every combination fed the teacher's greedy output, so the
# logits compare at every generated position. Its own rule, so it never reruns the matrix.
rule force_combination:
    input:
        unpack(forced_inputs),
    output:
        record="results/forced/{model}/{device}/{dequant}/record.json",
        data="results/forced/{model}/{device}/{dequant}/forced.npz",
    log:
        "results/logs/forced/{model}/{device}/{dequant}.log",
    benchmark:
        "results/benchmarks/forced/{model}/{device}/{dequant}.tsv"
    conda:
        run_env
    threads: run_threads
    resources:
        gpu=run_gpus,
        mem_mb=model_mem_mb,
    params:
        spec=forced_spec,
        llama_build=LLAMA_BUILD,
        format=RECORD_FORMAT,
        retry_token=forced_retry_token,
    script:
        "../scripts/force_combination.py"
