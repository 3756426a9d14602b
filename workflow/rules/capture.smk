# Tensor capture and localisation (qdiff.localise): which op two combinations part at.
# Their own rules, so enabling capture never reruns the matrix.


rule capture_combination:
    input:
        model=run_model,
        info=run_model_info,
    output:
        record="results/capture/{model}/{device}/{dequant}/record.json",
        data="results/capture/{model}/{device}/{dequant}/capture.npz",
    log:
        "results/logs/capture/{model}/{device}/{dequant}.log",
    benchmark:
        "results/benchmarks/capture/{model}/{device}/{dequant}.tsv"
    conda:
        run_env
    threads: run_threads
    resources:
        gpu=run_gpus,
        mem_mb=model_mem_mb,
    params:
        spec=capture_spec,
        llama_build=LLAMA_BUILD,
        format=RECORD_FORMAT,
        retry_token=capture_retry_token,
    script:
        "../scripts/run_combination.py"


rule localise_model:
    input:
        unpack(localise_inputs),
    output:
        "results/localise/{model}.json",
    log:
        "results/logs/localise/{model}.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        pairs=EXPERIMENT.capture["pairs"] if EXPERIMENT.capture_enabled else [],
        format=LOCALISE_FORMAT,
    script:
        "../scripts/localise_model.py"
