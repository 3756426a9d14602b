# The Markdown report and its machine-readable tables: always rendered, naming every failure.
# Flagged for Snakemake's own report (snakemake --report report.html): the summary as a
# page, the tables and the plots, captioned in workflow/report/.


rule report:
    input:
        unpack(report_inputs),
    output:
        summary=REPORT_FILES[0],
        pairs=report(
            REPORT_FILES[1], caption="../report/pairs.rst", category="2. Tables"
        ),
        runs=report(REPORT_FILES[2], caption="../report/runs.rst", category="2. Tables"),
        html=report(
            REPORT_FILES[3],
            caption="../report/summary.rst",
            category="1. Summary",
            labels={"page": "summary"},
        ),
        plots=report(
            directory("results/plots"),
            patterns=[PLOT_PATTERN],
            caption="../report/plots.rst",
            category="3. Plots",
            subcategory="{model}",
            labels={"plot": "{plot}"},
        ),
    log:
        "results/logs/report.log",
    conda:
        "../../envs/qdiff.yaml"
    # the last job: its models render side by side (qdiff.report.render_models)
    threads: report_threads
    params:
        code=CODE["render_report"],
        reference=EXPERIMENT.reference,
        writeup_claims=EXPERIMENT.report["writeup_claims"],
    script:
        "../scripts/render_report.py"
