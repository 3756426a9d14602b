# The exact answer of each model's weights, in float64 (qdiff.exact), and how far every
# combination is from it (qdiff.compare.distance). The reference reads the teacher's text, so only a
# change of the teacher reruns it; adding or changing other devices never does.


rule exact_reference:
    input:
        unpack(exact_inputs),
    output:
        **kept_outputs(
            {
                "record": exact_file("{model}", "record"),
                "data": exact_file("{model}", "data"),
            }
        ),
    log:
        "results/logs/exact/{model}.log",
    benchmark:
        "results/benchmarks/exact/{model}.tsv"
    conda:
        "../../envs/qdiff.yaml"
    threads: exact_threads
    resources:
        mem_mb=exact_mem_mb,
        runtime=120,
    params:
        top_k=EXPERIMENT.teacher_forcing["top_k"],
        n_tokens=EXPERIMENT.teacher_forcing["n_tokens"],  # of the teacher's text, as forced
        code=CODE["exact_reference"],
        retry_token=exact_retry_token,
    script:
        "../scripts/exact_reference.py"


# The same engine with llama.cpp's rounding sources switched on, one set at a time and each
# combination's all together (qdiff.exact.roundings): the first step of every prompt. Its
# params are the sets, so a device with other settings reruns it, another prompt too.
rule exact_roundings:
    input:
        unpack(roundings_inputs),
    output:
        **kept_outputs(
            {
                "record": exact_file("{model}", "roundings_record"),
                "data": exact_file("{model}", "roundings_data"),
            }
        ),
    log:
        "results/logs/exact/{model}.roundings.log",
    benchmark:
        "results/benchmarks/exact/{model}.roundings.tsv"
    conda:
        "../../envs/qdiff.yaml"
    threads: exact_threads
    resources:
        mem_mb=exact_mem_mb,
        runtime=120,
    params:
        configs=rounding_configs,
        code=CODE["exact_reference"],
        retry_token=roundings_retry_token,
    script:
        "../scripts/exact_reference.py"


# The exact answer along the text's windows (qdiff.core.text): the teacher's windows, at its
# token ids, so only a change of the teacher's text pass reruns it.
rule exact_text:
    input:
        unpack(exact_text_inputs),
    output:
        **kept_outputs(
            {
                "record": exact_file("{model}", "text_record"),
                "data": exact_file("{model}", "text_data"),
            }
        ),
    log:
        "results/logs/exact/{model}.text.log",
    benchmark:
        "results/benchmarks/exact/{model}.text.tsv"
    conda:
        "../../envs/qdiff.yaml"
    threads: exact_threads
    resources:
        mem_mb=exact_mem_mb,
        runtime=240,
    params:
        top_k=0,  # the teacher's token ids
        n_top=LEADING_KEPT,
        code=CODE["exact_reference"],
        retry_token=exact_text_retry_token,
    script:
        "../scripts/exact_reference.py"


rule distance_from_exact:
    input:
        unpack(distance_inputs),
    output:
        exact_file("{model}", "distance"),
    log:
        "results/logs/exact/{model}.distance.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        code=CODE["distance_from_exact"],
    script:
        "../scripts/distance_from_exact.py"


# Another model as the reference (config.reference_model): every combination of the other
# models against its reference run (llama-perplexity's KL-divergence view) and its exact answer.
rule distance_from_reference_model:
    input:
        unpack(reference_model_inputs),
    output:
        reference_model_file("{model}"),
    log:
        "results/logs/reference/{model}.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        reference=EXPERIMENT.reference_model,
        code=CODE["distance_from_reference_model"],
    script:
        "../scripts/distance_from_reference_model.py"
