# Models: fetch each configured GGUF, derive requantized models, make dequantized copies.
# Each writes the file and its JSON sidecar; a failure writes a sidecar that says why (and an
# empty file), so the runs of that model fail with the reason and the report still renders.


# Downloads run where Snakemake runs: cluster compute nodes often have no network.
localrules:
    fetch_model,


rule fetch_model:
    output:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    log:
        "results/logs/fetch_model/{model}.log",
    wildcard_constraints:
        model=alternation(FETCHED),
    conda:
        "../../envs/qdiff.yaml"
    params:
        source=fetch_params,
        retry_token=model_retry_token,
    script:
        "../scripts/fetch_model.py"


rule requantize_model:
    input:
        gguf=parent_model,
        info=parent_model_info,
    output:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    log:
        "results/logs/requantize_model/{model}.log",
    wildcard_constraints:
        model=alternation(DERIVED) if DERIVED else "(?!)",
    conda:
        "../../envs/cpu.yaml"
    threads: 2
    resources:
        mem_mb=model_mem_mb,
    params:
        target=requant_type,
        llama_build=LLAMA_BUILD,
        retry_token=model_retry_token,
    script:
        "../scripts/derive_model.py"


use rule requantize_model as dequantize_model with:
    input:
        gguf=ancient("resources/models/{model}.gguf"),
        info="resources/models/{model}.gguf.json",
    output:
        gguf="resources/models/{model}.dequant-{dqcopy}.gguf",
        info="resources/models/{model}.dequant-{dqcopy}.gguf.json",
    log:
        "results/logs/dequantize_model/{model}.{dqcopy}.log",
    wildcard_constraints:
        model=alternation(EXPERIMENT.models),
    params:
        target="{dqcopy}",
        llama_build=LLAMA_BUILD,
        retry_token=model_retry_token,
