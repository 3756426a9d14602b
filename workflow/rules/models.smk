# Models: fetch each configured GGUF, derive requantized models, make dequantized copies.
# Every output is written under a temporary name and renamed when verified.


rule fetch_model:
    output:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    wildcard_constraints:
        model=alternation(FETCHED),
    params:
        source=fetch_params,
    retries: 2
    log:
        "results/logs/fetch_model/{model}.log",
    script:
        "../scripts/fetch_model.py"


rule requantize_model:
    input:
        gguf=parent_model,
        info=parent_model_info,
    output:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    wildcard_constraints:
        model=alternation(DERIVED) if DERIVED else "(?!)",
    params:
        target=requant_type,
    threads: 2
    log:
        "results/logs/requantize_model/{model}.log",
    script:
        "../scripts/quantize_model.py"


rule dequantize_model:
    input:
        gguf="resources/models/{model}.gguf",
        info="resources/models/{model}.gguf.json",
    output:
        gguf="resources/models/{model}.dequant-{dqcopy}.gguf",
        info="resources/models/{model}.dequant-{dqcopy}.gguf.json",
    params:
        target="{dqcopy}",
    threads: 2
    log:
        "results/logs/dequantize_model/{model}.{dqcopy}.log",
    script:
        "../scripts/quantize_model.py"
