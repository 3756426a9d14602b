# Models: fetch each configured GGUF, derive requantized models, make dequantized copies.
# Every output is written under a temporary name and renamed when verified.


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
    retries: 2
    conda:
        "../../envs/qdiff.yaml"
    params:
        source=fetch_params,
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
    script:
        "../scripts/quantize_model.py"


rule dequantize_model:
    input:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    output:
        gguf="resources/models/{model}.dequant-{dqcopy}.gguf",
        info="resources/models/{model}.dequant-{dqcopy}.gguf.json",
    log:
        "results/logs/dequantize_model/{model}.{dqcopy}.log",
    conda:
        "../../envs/cpu.yaml"
    threads: 2
    resources:
        mem_mb=model_mem_mb,
    params:
        target="{dqcopy}",
    script:
        "../scripts/quantize_model.py"
