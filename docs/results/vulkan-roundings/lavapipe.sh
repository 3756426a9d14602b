#!/usr/bin/env bash
# llama.cpp's Vulkan backend on a Debian 12 machine without a GPU: Mesa's lavapipe (README.md
# here). From the repository's root, after ./setup and docs/results/seed-long/carry.sh (its
# .carry/llama-cpp-python-0.3.36.tgz, the trimmed sdist, and .carry/vk13, Debian 13's Vulkan
# and SPIR-V headers: Debian 12's are too old for the vendored ggml-vulkan):
#   bash docs/results/vulkan-roundings/lavapipe.sh build            # about 5 min on 2 cores
#   bash docs/results/vulkan-roundings/lavapipe.sh capture [OUT [MODE]]  # about 3 min
# (MODE: capture.py's ub1, kv32 or fa; none: its default captures)
# The build goes into $QDIFF_LAVAPIPE_SITE (default /tmp/vksite), outside .venv: put it first
# on PYTHONPATH to use it. llama.cpp skips a CPU-type Vulkan device unless
# GGML_VK_VISIBLE_DEVICES names it.
set -euo pipefail
SITE=${QDIFF_LAVAPIPE_SITE:-/tmp/vksite}
case "${1:-}" in
build)
    apt-get install -y -q mesa-vulkan-drivers glslc vulkan-tools
    rm -rf /tmp/vk /tmp/vkwheel && mkdir -p /tmp/vk /tmp/vkwheel
    for f in .carry/vk13/libvulkan-dev_*.deb .carry/vk13/spirv-headers_*.deb; do
        dpkg -x "$f" /tmp/vk
    done
    CMAKE_ARGS="-DGGML_VULKAN=on -DLLAVA_BUILD=OFF -DVulkan_INCLUDE_DIR=/tmp/vk/usr/include \
-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 -DVulkan_GLSLC_EXECUTABLE=/usr/bin/glslc \
-DSPIRV-Headers_DIR=/tmp/vk/usr/share/cmake/SPIRV-Headers" \
        .venv/bin/python -m pip wheel -q --no-deps -w /tmp/vkwheel .carry/llama-cpp-python-0.3.36.tgz
    rm -rf "$SITE"
    .venv/bin/python -m pip install -q --no-deps --target "$SITE" /tmp/vkwheel/llama_cpp_python-*.whl
    ;;
capture)
    GGML_VK_VISIBLE_DEVICES=0 PYTHONPATH="$SITE" .venv/bin/python \
        docs/results/cuda-roundings/capture.py "${2:-/tmp/lvp}" vulkan ${3:+"$3"}
    ;;
*)
    echo "usage: lavapipe.sh build | capture [OUT [MODE]]" >&2
    exit 2
    ;;
esac
