# The Markdown report and its machine-readable tables.


rule report:
    input:
        records=all_run_records,
        logits=all_run_logits,
        pairs=all_pair_files,
        forced=all_forced_records,
        localised=all_localise_files,
    output:
        summary=REPORT_FILES[0],
        pairs=REPORT_FILES[1],
        runs=REPORT_FILES[2],
        plots=directory("results/plots"),
    log:
        "results/logs/report.log",
    conda:
        "../../envs/qdiff.yaml"
    params:
        reference=EXPERIMENT.reference,
    script:
        "../scripts/render_report.py"
