# One job per pair of combinations of the same model, so a changed device reruns only its
# pairs; and, per model, where its pairs part op by op.


rule compare_pair:
    input:
        unpack(compare_inputs),
    output:
        f"results/compare/{{model}}/{PAIR_STEM_WILDCARDS}.json",
    log:
        f"results/logs/compare/{{model}}/{PAIR_STEM_WILDCARDS}.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        format=COMPARE_FORMAT,
    script:
        "../scripts/compare_pair.py"


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
