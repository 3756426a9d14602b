#!/usr/bin/env bash
# llama.cpp's Vulkan backend on a Debian 12 machine without a GPU: Mesa's lavapipe (README.md
# here). From the repository's root, after ./setup and docs/results/seed-long/carry.sh (its
# .carry/llama-cpp-python-0.3.36.tgz, the trimmed sdist, and .carry/vk13, Debian 13's Vulkan
# and SPIR-V headers, glslc and libshaderc: Debian 12's headers are too old for the vendored
# ggml-vulkan, and its glslc lacks GL_EXT_integer_dot_product):
#   bash docs/results/vulkan-roundings/lavapipe.sh build            # about 8 min on 2 cores
#   bash docs/results/vulkan-roundings/lavapipe.sh capture [OUT [MODE]]  # about 3 min
# (MODE: capture.py's ub1, kv32, kv32-wide or fa; int: its default captures with integer dot products;
# none: its default captures)
# The build applies int-dot.patch: with QDIFF_VK_INT_DOT_UNACCELERATED set, ggml-vulkan
# takes lavapipe's integer dot products, which it otherwise skips as not accelerated; the
# shaders are the vendored ones. Debian 13's glslc runs through Debian 13's own loader and
# C and C++ libraries (fetched here from the Debian mirror into /tmp/vk13libc).
# The build goes into $QDIFF_LAVAPIPE_SITE (default /tmp/vksite), outside .venv: put it first
# on PYTHONPATH to use it. llama.cpp skips a CPU-type Vulkan device unless
# GGML_VK_VISIBLE_DEVICES names it.
set -euo pipefail
SITE=${QDIFF_LAVAPIPE_SITE:-/tmp/vksite}
HERE=docs/results/vulkan-roundings
case "${1:-}" in
build)
    apt-get install -y -q mesa-vulkan-drivers vulkan-tools
    rm -rf /tmp/vk /tmp/vkwheel /tmp/vksrc && mkdir -p /tmp/vk /tmp/vkwheel /tmp/vksrc
    for f in .carry/vk13/*.deb; do
        dpkg -x "$f" /tmp/vk
    done
    # Debian 13's loader, libc and libstdc++ for its glslc (apt's own lists, as carry.sh)
    A=/tmp/vk13libc/apt
    mkdir -p "$A/lists/partial" "$A/cache/archives/partial" /tmp/vk13libc/root
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" >"$A/sources.list"
    o=(-o "Dir::Etc::SourceList=$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache"
        -o APT::Architecture=amd64 -o APT::Architectures=amd64)
    apt-get -q "${o[@]}" update >/dev/null
    (cd /tmp/vk13libc && apt-get -q "${o[@]}" download libc6 libstdc++6 libgcc-s1)
    for f in /tmp/vk13libc/*.deb; do
        dpkg -x "$f" /tmp/vk13libc/root
    done
    cat >/tmp/vk/glslc <<'EOF'
#!/bin/sh
R=/tmp/vk13libc/root/usr/lib/x86_64-linux-gnu
exec "$R/ld-linux-x86-64.so.2" --library-path "$R:/tmp/vk/usr/lib/x86_64-linux-gnu" /tmp/vk/usr/bin/glslc "$@"
EOF
    chmod +x /tmp/vk/glslc
    tar xzf .carry/llama-cpp-python-0.3.36.tgz -C /tmp/vksrc
    patch -d /tmp/vksrc/trim -p1 <"$HERE/int-dot.patch"
    CMAKE_ARGS="-DGGML_VULKAN=on -DLLAVA_BUILD=OFF -DVulkan_INCLUDE_DIR=/tmp/vk/usr/include \
-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 -DVulkan_GLSLC_EXECUTABLE=/tmp/vk/glslc \
-DSPIRV-Headers_DIR=/tmp/vk/usr/share/cmake/SPIRV-Headers" \
        .venv/bin/python -m pip wheel -q --no-deps -w /tmp/vkwheel /tmp/vksrc/trim
    rm -rf "$SITE"
    .venv/bin/python -m pip install -q --no-deps --target "$SITE" /tmp/vkwheel/llama_cpp_python-*.whl
    ;;
capture)
    mode=${3:-}
    if [ "$mode" = int ]; then
        export QDIFF_VK_INT_DOT_UNACCELERATED=1
        mode=
    fi
    GGML_VK_VISIBLE_DEVICES=0 PYTHONPATH="$SITE" .venv/bin/python \
        docs/results/cuda-roundings/capture.py "${2:-/tmp/lvp}" vulkan ${mode:+"$mode"}
    ;;
*)
    echo "usage: lavapipe.sh build | capture [OUT [MODE]]" >&2
    exit 2
    ;;
esac
