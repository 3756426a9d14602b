# Per model: every pair of its combinations in one job (qdiff.compare.pairs.compare_model), which
# reuses each pair whose files did not change, so a changed device recomputes only its own
# pairs; and where its pairs part, op by op.


rule compare_model:
    input:
        unpack(compare_inputs),
    output:
        compare_file("{model}"),
    log:
        "results/logs/compare/{model}.log",
    benchmark:
        "results/benchmarks/compare/{model}.tsv"
    conda:
        "../../envs/qdiff.yaml"
    threads: 1
    resources:
        mem_mb=compare_mem_mb,
    params:
        combinations=combination_labels,
        pairs=pair_labels,
        code=CODE["compare_model"],
    script:
        "../scripts/compare_model.py"


rule localise_model:
    input:
        unpack(localise_inputs),
    output:
        localise_file("{model}"),
    log:
        "results/logs/localise/{model}.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        pairs=EXPERIMENT.capture["pairs"] if EXPERIMENT.capture_enabled else [],
        code=CODE["localise_model"],
    script:
        "../scripts/localise_model.py"


# Per model: every combination along the text against the exact answer and against each
# other, with llama-perplexity's statistics (qdiff.compare.text).
rule compare_text:
    input:
        unpack(text_compare_inputs),
    output:
        text_compare_file("{model}"),
    log:
        "results/logs/compare/{model}.text.log",
    conda:
        "../../envs/qdiff.yaml"
    resources:
        mem_mb=compare_mem_mb,
    params:
        combinations=combination_labels,
        reference_model=EXPERIMENT.reference_model,
        source=(
            {k: EXPERIMENT.text[k] for k in ("file", "sha256", "about")}
            if EXPERIMENT.text_enabled
            else {}
        ),
        code=CODE["compare_text"],
    script:
        "../scripts/compare_text.py"
