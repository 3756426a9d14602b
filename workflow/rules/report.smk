# The Markdown report and its machine-readable tables: always rendered, naming every failure.


rule report:
    input:
        unpack(report_inputs),
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
        writeup_claims=EXPERIMENT.report["writeup_claims"],
    script:
        "../scripts/render_report.py"
