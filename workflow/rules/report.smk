# The Markdown report and its machine-readable tables.


rule report:
    input:
        records=all_run_records,
        pairs=all_pair_files,
    output:
        summary=REPORT_FILES[0],
        pairs=REPORT_FILES[1],
        runs=REPORT_FILES[2],
    log:
        "results/logs/report.log",
    conda:
        "../../envs/qdiff.yaml"
    script:
        "../scripts/render_report.py"
