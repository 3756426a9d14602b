# One job per pair of combinations of the same model, so a changed device reruns only its pairs.


rule compare_pair:
    input:
        unpack(compare_inputs),
    output:
        "results/compare/{model}/{dev_a}.{dq_a}__{dev_b}.{dq_b}.json",
    log:
        "results/logs/compare/{model}/{dev_a}.{dq_a}__{dev_b}.{dq_b}.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        format=COMPARE_FORMAT,
    script:
        "../scripts/compare_pair.py"
